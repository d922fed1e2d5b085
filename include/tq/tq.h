// Umbrella header of the turboquant C++ library: codecs, KV caches,
// attention and the vector index (the CUDA backend is tq/cuda.h, in the
// tq_cuda library; the model runner and metrics have headers of their own).
#ifndef TQ_TQ_H_
#define TQ_TQ_H_

#include "tq/attention.h"
#include "tq/codebook.h"
#include "tq/codec.h"
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

#endif  // TQ_TQ_H_
