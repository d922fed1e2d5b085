#ifndef TQ_VERSION_H_
#define TQ_VERSION_H_

#define TQ_VERSION_MAJOR 0
#define TQ_VERSION_MINOR 1
#define TQ_VERSION_PATCH 0

namespace tq {
// Name of the SIMD target the dispatcher picked on this CPU ("AVX3", "AVX2", ...).
const char* ActiveSimdTarget();
}  // namespace tq

#endif  // TQ_VERSION_H_
