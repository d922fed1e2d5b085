// The library's version.
#ifndef TQ_VERSION_H_
#define TQ_VERSION_H_

#define TQ_VERSION_MAJOR 0
#define TQ_VERSION_MINOR 1
#define TQ_VERSION_PATCH 0

#endif  // TQ_VERSION_H_
