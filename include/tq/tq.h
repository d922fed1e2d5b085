// Umbrella header of the core turboquant C++ library (tq, target tq::tq):
// every public header of the codecs, KV caches, attention and the vector
// index. Not here: the CUDA backend (tq/cuda.h, library tq_cuda) and the
// evaluation tooling (tq/metrics.h, tq/model.h, library tq_eval, target
// tq::eval), each in a library of its own.
#ifndef TQ_TQ_H_
#define TQ_TQ_H_

#include "tq/attention.h"
#include "tq/codebook.h"
#include "tq/codec.h"
#include "tq/distortion.h"
#include "tq/dtype.h"
#include "tq/format.h"
#include "tq/index.h"
#include "tq/kv_cache.h"
#include "tq/kv_format.h"
#include "tq/paged_kv_cache.h"
#include "tq/random.h"
#include "tq/rotation.h"
#include "tq/simd.h"
#include "tq/status.h"
#include "tq/version.h"
#include "tq/weights.h"

#endif  // TQ_TQ_H_
