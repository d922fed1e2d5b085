// Umbrella header of the turboquant C++ library.
#ifndef TQ_TQ_H_
#define TQ_TQ_H_

#include "tq/codebook.h"
#include "tq/codec.h"
#include "tq/format.h"
#include "tq/random.h"
#include "tq/rotation.h"
#include "tq/status.h"
#include "tq/version.h"

#endif  // TQ_TQ_H_
