// Host API of the CUDA backend (include/tq/cuda.h): validation, device
// tables, planning and launches.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "internal.cuh"
#include "tq/codebook.h"
#include "tq/codec.h"
#include "tq/cuda.h"
#include "tq/rotation.h"

namespace tq::cuda {
namespace {

using detail::Comp;
using detail::Layer;

std::string Str(size_t v) { return std::to_string(v); }

Status CudaError(cudaError_t e, const std::string& what) {
  return InternalError("CUDA " + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

#define TQ_CUDA_RETURN(expr, what)                 \
  do {                                             \
    const cudaError_t tq_e_ = (expr);              \
    if (tq_e_ != cudaSuccess) return CudaError(tq_e_, what); \
  } while (0)

constexpr const char* kSupported =
    "supported on the GPU: head_dim 64, 128 or 256; block_size a power of two up to 1024; "
    "keys tq-mse2/3/4 or int8-sym with a group that is a multiple of 32 channels (presets kK_vV with K in 2, 3, 4, 8; q8; turboquant_k8v4); values tq-mse2/3/4 or int-asym4/8 "
    "with a group that is a multiple of 32 channels (g32 or row); 1..8 query heads per KV head";

bool IsPow2(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

Status CheckTq(const KVFormat& f, const char* role) {
  if (f.kind != KVFormatKind::kTurboMse) {
    return UnimplementedError(std::string(role) + " format " + ToString(f) + " is not supported; " + kSupported);
  }
  if (f.bits < 2 || f.bits > 4) {
    return UnimplementedError(std::string(role) + " format " + ToString(f) + " (" + std::to_string(f.bits) +
                              " bits) is not supported; " + kSupported);
  }
  if (f.rotation != RotationKind::kBlockHadamard && f.rotation != RotationKind::kHadamard) {
    return UnimplementedError(std::string(role) + " rotation " + RotationKindName(f.rotation) +
                              " is not supported (Hadamard only); " + kSupported);
  }
  return Status::Ok();
}

size_t EffectiveGroup(const KVFormat& f, size_t d) {
  if (f.group_size == kGroupAuto) return std::gcd(size_t{32}, d);
  if (f.group_size == kGroupRow) return d;
  return f.group_size;
}

}  // namespace

bool DeviceAvailable() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::string DeviceDescription() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(e);
  }
  if (n == 0) return "no CUDA device";
  int dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return "CUDA device (properties unavailable)";
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " +
         std::to_string(p.totalGlobalMem >> 20) + " MiB)";
}

Status Synchronize(void* stream) {
  TQ_CUDA_RETURN(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "stream synchronize");
  TQ_CUDA_RETURN(cudaGetLastError(), "asynchronous error");
  return Status::Ok();
}

Status IsSupported(const KVFormat& key, const KVFormat& value, size_t head_dim, size_t block_size,
                   size_t gqa_ratio) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    return UnimplementedError("head_dim " + Str(head_dim) + " is not supported; " + kSupported);
  }
  if (!IsPow2(block_size) || block_size > 1024) {
    return UnimplementedError("block_size " + Str(block_size) + " is not supported; " + kSupported);
  }
  if (gqa_ratio < 1 || gqa_ratio > 8) {
    return UnimplementedError("GQA ratio " + Str(gqa_ratio) + " is not supported; " + kSupported);
  }
  if (key.kind == KVFormatKind::kInt8Sym) {
    const size_t g = EffectiveGroup(key, head_dim);
    if (g % 32 != 0 || head_dim % g != 0) {
      return UnimplementedError("key format " + ToString(key) + " is not supported; " + kSupported);
    }
  } else {
    TQ_RETURN_IF_ERROR(CheckTq(key, "key"));
  }
  if (value.kind == KVFormatKind::kTurboMse) return CheckTq(value, "value");
  if (value.kind == KVFormatKind::kIntAsym) {
    const size_t g = EffectiveGroup(value, head_dim);
    if ((value.bits != 4 && value.bits != 8) || g % 32 != 0 || head_dim % g != 0) {
      return UnimplementedError("value format " + ToString(value) + " is not supported; " + kSupported);
    }
    return Status::Ok();
  }
  return UnimplementedError("value format " + ToString(value) + " is not supported; " + kSupported);
}

// ---------------------------------------------------------------------------
// DeviceBuffer
// ---------------------------------------------------------------------------
Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  const cudaError_t e = cudaMalloc(&b.ptr_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    b.ptr_ = nullptr;
    return CudaError(e, "cudaMalloc(" + Str(bytes) + " bytes)");
  }
  b.bytes_ = bytes;
  return b;
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}
Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return OutOfRangeError("DeviceBuffer: copy of " + Str(bytes) + " bytes at " + Str(offset) +
                           " exceeds the buffer (" + Str(bytes_) + " bytes)");
  }
  if (bytes == 0) return Status::Ok();
  TQ_CUDA_RETURN(cudaMemcpy(static_cast<uint8_t*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice),
                 "copy to device");
  return Status::Ok();
}
Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return OutOfRangeError("DeviceBuffer: copy of " + Str(bytes) + " bytes at " + Str(offset) +
                           " exceeds the buffer (" + Str(bytes_) + " bytes)");
  }
  if (bytes == 0) return Status::Ok();
  TQ_CUDA_RETURN(cudaMemcpy(dst, static_cast<const uint8_t*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost),
                 "copy to host");
  return Status::Ok();
}
Status DeviceBuffer::Fill(uint8_t byte) {
  if (bytes_ == 0) return Status::Ok();
  TQ_CUDA_RETURN(cudaMemset(ptr_, byte, bytes_), "memset");
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// DeviceLayer
// ---------------------------------------------------------------------------
struct DeviceLayer::Impl {
  Layer layer;
  KVFormat kfmt, vfmt;
  size_t num_blocks = 0;
  PlaneBytes bytes;
  DeviceBuffer k_codes, k_meta, v_codes, v_meta;  // owned planes (may be empty)
  DeviceBuffer tables;                             // signs, codebooks, pairs, means
  DeviceBuffer counters;                           // detail::WriteCounters
  DeviceBuffer means;                              // [2][H][D] f32 of SetMeansFromChunk
  bool has_planes = false;
  bool written = false;                            // WriteSlots was called
  int sm_count = 0;
};

namespace {

// Host image of one component's tables, appended to `blob` (4-byte words).
struct CompTables {
  size_t signs1 = 0, signs2 = 0, lane_signs1 = 0, lane_signs2 = 0, pairs = 0, mean = 0,
         buckets = 0;  // word offsets
  bool has_mean = false;
  detail::BucketGrid grid;
};

Status BuildComp(const PagedComponentView& view, size_t H, size_t D, std::vector<uint32_t>& blob,
                 CompTables& off) {
  const KVFormat& f = view.codecs[0]->format();
  if (f.kind == KVFormatKind::kTurboMse) {
    off.signs1 = blob.size();
    for (int round = 0; round < 2; ++round) {
      if (round == 1) off.signs2 = blob.size();
      for (size_t h = 0; h < H; ++h) {
        const Codec* c = view.codecs[h]->codec();
        if (c == nullptr || c->rotation().block_sizes().size() != 1) {
          return InternalError("CUDA layer: head " + Str(h) + " has no single-block Hadamard codec");
        }
        const float* s = c->rotation().signs(round);
        for (size_t w = 0; w < D / 32; ++w) {
          uint32_t m = 0;
          for (size_t e = 0; e < 32; ++e) {
            if (s[32 * w + e] < 0) m |= 1u << e;
          }
          blob.push_back(m);
        }
      }
    }
    // Lane order of the write kernel (write.cu, Tq): lane `sub` of a row
    // holds W = 512 / D channels of each group of 16, element e = channel
    // 16 (e / W) + W sub + e % W.
    const size_t lanes = D / 32, W = 16 / lanes;
    for (int round = 0; round < 2; ++round) {
      (round == 0 ? off.lane_signs1 : off.lane_signs2) = blob.size();
      const size_t src = round == 0 ? off.signs1 : off.signs2;
      for (size_t h = 0; h < H; ++h) {
        for (size_t sub = 0; sub < lanes; ++sub) {
          uint32_t m = 0;
          for (size_t e = 0; e < 32; ++e) {
            const size_t ch = 16 * (e / W) + W * sub + e % W;
            if ((blob[src + h * lanes + ch / 32] >> (ch % 32)) & 1u) m |= 1u << e;
          }
          blob.push_back(m);
        }
      }
    }
    const Codebook* cb = view.codecs[0]->codec()->codebook(0);
    const size_t n = cb->size();
    off.pairs = blob.size();
    for (size_t e = 0; e < n * n; ++e) {
      const __half lo = __float2half_rn(cb->centroids()[e % n]);
      const __half hi = __float2half_rn(cb->centroids()[e / n]);
      uint16_t l16, h16;
      std::memcpy(&l16, &lo, 2);
      std::memcpy(&h16, &hi, 2);
      blob.push_back(static_cast<uint32_t>(l16) | (static_cast<uint32_t>(h16) << 16));
    }
    std::vector<detail::BucketRecord> recs;
    std::string why;
    if (!detail::BuildBuckets(cb->boundaries(), static_cast<int>(n) - 1, cb->centroids(), &off.grid, &recs, &why)) {
      return InvalidArgumentError("CUDA layer: " + why);
    }
    while (blob.size() % 4 != 0) blob.push_back(0);  // 16-byte records
    off.buckets = blob.size();
    const size_t words = recs.size() * sizeof(detail::BucketRecord) / 4;
    blob.resize(blob.size() + words);
    std::memcpy(blob.data() + off.buckets, recs.data(), words * 4);
    // Every head must share the codebook (same dim and bits).
    for (size_t h = 1; h < H; ++h) {
      if (view.codecs[h]->codec()->codebook(0)->fingerprint() != cb->fingerprint()) {
        return InternalError("CUDA layer: heads use different codebooks");
      }
    }
  }
  if (view.mean != nullptr) {
    off.has_mean = true;
    off.mean = blob.size();
    for (size_t i = 0; i < H * D; ++i) {
      uint32_t w;
      std::memcpy(&w, &view.mean[i], 4);
      blob.push_back(w);
    }
  }
  return Status::Ok();
}

void FillComp(const PagedComponentView& view, size_t D, const CompTables& off, const uint32_t* base,
              Comp& c) {
  const KVFormat& f = view.codecs[0]->format();
  c.kind = f.kind == KVFormatKind::kTurboMse ? detail::kCompTq
           : f.kind == KVFormatKind::kInt8Sym ? detail::kCompInt8Sym
                                               : detail::kCompInt;
  c.bits = f.bits;
  c.payload = static_cast<int>(view.payload_bytes);
  c.stride = static_cast<int>(view.payload_stride);
  c.meta_bytes = static_cast<int>(view.meta_bytes);
  c.group = static_cast<int>(EffectiveGroup(f, D));
  if (c.kind == detail::kCompTq) {
    c.signs1 = base + off.signs1;
    c.signs2 = base + off.signs2;
    c.lane_signs1 = base + off.lane_signs1;
    c.lane_signs2 = base + off.lane_signs2;
    c.pairs = base + off.pairs;
    c.buckets = reinterpret_cast<const detail::BucketRecord*>(base + off.buckets);
    c.bucket_s = off.grid.s;
    c.bucket_o = off.grid.o;
    c.bucket_n = off.grid.n;
    c.bucket_cells = off.grid.cells;
    c.bucket_bias = 0u - (0x4b000000u << 7);
  }
  c.mean = off.has_mean ? reinterpret_cast<const float*>(base + off.mean) : nullptr;
}

}  // namespace

DeviceLayer::DeviceLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceLayer::DeviceLayer(DeviceLayer&&) noexcept = default;
DeviceLayer& DeviceLayer::operator=(DeviceLayer&&) noexcept = default;
DeviceLayer::~DeviceLayer() = default;

size_t DeviceLayer::num_blocks() const { return impl_->num_blocks; }
size_t DeviceLayer::block_size() const { return static_cast<size_t>(impl_->layer.block_size); }
size_t DeviceLayer::num_kv_heads() const { return static_cast<size_t>(impl_->layer.H); }
size_t DeviceLayer::head_dim() const { return static_cast<size_t>(impl_->layer.D); }
PlaneBytes DeviceLayer::plane_bytes() const { return impl_->bytes; }
DevicePlanes DeviceLayer::planes() const {
  const Layer& L = impl_->layer;
  return {L.k.codes, L.k.meta, L.v.codes, L.v.meta};
}

Result<DeviceLayer> DeviceLayer::Create(const PagedKVCache& like, size_t layer, size_t num_blocks,
                                        bool allocate_planes) {
  Result<PagedLayerView> vr = like.View(layer);
  if (!vr.ok()) return vr.status();
  const PagedLayerView& view = *vr;
  const size_t H = view.num_kv_heads, D = view.head_dim, bs = view.block_size;
  const KVFormat kf = view.k.codecs[0]->format(), vf = view.v.codecs[0]->format();
  TQ_RETURN_IF_ERROR(IsSupported(kf, vf, D, bs, 1));
  if (!DeviceAvailable()) return FailedPreconditionError("CUDA layer: " + DeviceDescription());
  if (num_blocks == 0) num_blocks = view.num_blocks;
  if (num_blocks > (size_t{1} << 30)) {
    return InvalidArgumentError("num_blocks must be in 1..2^30, got " + Str(num_blocks));
  }
  if (num_blocks * H * bs > size_t{0xFFFFFFFF}) {  // the decode kernels index rows in 32 bits
    return InvalidArgumentError("num_blocks x kv_heads x block_size (rows of a plane) must be below 2^32, got " +
                                Str(num_blocks) + " x " + Str(H) + " x " + Str(bs));
  }
  auto impl = std::make_unique<Impl>();
  impl->kfmt = kf;
  impl->vfmt = vf;
  impl->num_blocks = num_blocks;
  const size_t rows = num_blocks * H * bs;
  impl->bytes = {rows * view.k.payload_stride, rows * view.k.meta_bytes, rows * view.v.payload_stride,
                 rows * view.v.meta_bytes};
  std::vector<uint32_t> blob;
  CompTables kt, vt;
  TQ_RETURN_IF_ERROR(BuildComp(view.k, H, D, blob, kt));
  TQ_RETURN_IF_ERROR(BuildComp(view.v, H, D, blob, vt));
  TQ_ASSIGN_OR_RETURN(impl->tables, DeviceBuffer::Allocate(std::max<size_t>(blob.size(), 1) * 4));
  TQ_RETURN_IF_ERROR(impl->tables.CopyFromHost(blob.data(), blob.size() * 4));
  TQ_ASSIGN_OR_RETURN(impl->counters, DeviceBuffer::Allocate(sizeof(detail::WriteCounters)));
  detail::WriteCounters zero{0, 0, 0, ULLONG_MAX, 0};
  TQ_RETURN_IF_ERROR(impl->counters.CopyFromHost(&zero, sizeof(zero)));
  Layer& L = impl->layer;
  L.H = static_cast<int>(H);
  L.D = static_cast<int>(D);
  L.block_size = static_cast<int>(bs);
  L.log2_block = 0;
  while ((size_t{1} << L.log2_block) < bs) ++L.log2_block;
  L.num_blocks = static_cast<long long>(num_blocks);
  const uint32_t* base = static_cast<const uint32_t*>(impl->tables.data());
  FillComp(view.k, D, kt, base, L.k);
  FillComp(view.v, D, vt, base, L.v);
  int dev = 0;
  TQ_CUDA_RETURN(cudaGetDevice(&dev), "cudaGetDevice");
  TQ_CUDA_RETURN(cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, dev),
                 "device attribute");
  if (allocate_planes) {
    TQ_ASSIGN_OR_RETURN(impl->k_codes, DeviceBuffer::Allocate(impl->bytes.k_codes));
    TQ_ASSIGN_OR_RETURN(impl->k_meta, DeviceBuffer::Allocate(impl->bytes.k_meta));
    TQ_ASSIGN_OR_RETURN(impl->v_codes, DeviceBuffer::Allocate(impl->bytes.v_codes));
    TQ_ASSIGN_OR_RETURN(impl->v_meta, DeviceBuffer::Allocate(impl->bytes.v_meta));
    TQ_RETURN_IF_ERROR(impl->k_codes.Fill(0));
    TQ_RETURN_IF_ERROR(impl->k_meta.Fill(0));
    TQ_RETURN_IF_ERROR(impl->v_codes.Fill(0));
    TQ_RETURN_IF_ERROR(impl->v_meta.Fill(0));
    L.k.codes = static_cast<uint8_t*>(impl->k_codes.data());
    L.k.meta = static_cast<uint8_t*>(impl->k_meta.data());
    L.v.codes = static_cast<uint8_t*>(impl->v_codes.data());
    L.v.meta = static_cast<uint8_t*>(impl->v_meta.data());
    impl->has_planes = true;
  }
  return DeviceLayer(std::move(impl));
}

Status DeviceLayer::BorrowPlanes(const DevicePlanes& p) {
  const PlaneBytes& b = impl_->bytes;
  auto bad = [](const void* ptr, size_t need, size_t align) {
    return (need > 0 && ptr == nullptr) || (reinterpret_cast<uintptr_t>(ptr) % align) != 0;
  };
  if (bad(p.k_codes, b.k_codes, 16) || bad(p.v_codes, b.v_codes, 16) || bad(p.k_meta, b.k_meta, 16) ||
      bad(p.v_meta, b.v_meta, 16)) {
    return InvalidArgumentError(
        "BorrowPlanes: codes planes must be non-null and 16-byte aligned, meta planes non-null "
        "(when the format has metadata) and 16-byte aligned");
  }
  Layer& L = impl_->layer;
  L.k.codes = static_cast<uint8_t*>(p.k_codes);
  L.k.meta = static_cast<uint8_t*>(p.k_meta);
  L.v.codes = static_cast<uint8_t*>(p.v_codes);
  L.v.meta = static_cast<uint8_t*>(p.v_meta);
  impl_->k_codes = DeviceBuffer();
  impl_->k_meta = DeviceBuffer();
  impl_->v_codes = DeviceBuffer();
  impl_->v_meta = DeviceBuffer();
  impl_->has_planes = true;
  return Status::Ok();
}

namespace {
int DtypeCode(DType d) { return static_cast<int>(d); }
bool ValidDtype(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }
}  // namespace

Status DeviceLayer::WriteSlots(const void* k, const void* v, DType dtype, size_t tokens,
                               const int64_t* slot_mapping, void* stream) {
  if (!impl_->has_planes) return FailedPreconditionError("WriteSlots: the layer has no planes (BorrowPlanes)");
  if (!ValidDtype(dtype)) return InvalidArgumentError("WriteSlots: dtype must be f32, f16 or bf16");
  if (tokens == 0) return Status::Ok();
  if (k == nullptr || v == nullptr || slot_mapping == nullptr) {
    return InvalidArgumentError("WriteSlots: k, v and slot_mapping must be device pointers, got null");
  }
  if (reinterpret_cast<uintptr_t>(k) % 16 != 0 || reinterpret_cast<uintptr_t>(v) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(slot_mapping) % 8 != 0) {
    return InvalidArgumentError("WriteSlots: k and v must be 16-byte aligned, slot_mapping 8-byte aligned");
  }
  if (tokens > (size_t{1} << 40) / impl_->layer.H) return InvalidArgumentError("WriteSlots: too many tokens");
  impl_->written = true;
  const cudaError_t e = detail::LaunchWrite(impl_->layer, k, v, DtypeCode(dtype), static_cast<long long>(tokens),
                                            slot_mapping, static_cast<detail::WriteCounters*>(impl_->counters.data()),
                                            static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return CudaError(e, "write kernel launch");
  return Status::Ok();
}

Result<WriteErrors> DeviceLayer::TakeErrors(void* stream) {
  TQ_CUDA_RETURN(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "stream synchronize");
  detail::WriteCounters c{};
  TQ_RETURN_IF_ERROR(impl_->counters.CopyToHost(&c, sizeof(c)));
  detail::WriteCounters zero{0, 0, 0, ULLONG_MAX, 0};
  TQ_RETURN_IF_ERROR(impl_->counters.CopyFromHost(&zero, sizeof(zero)));
  WriteErrors w;
  w.out_of_range_slots = c.out_of_range;
  w.non_finite_inputs = c.non_finite;
  w.scale_overflows = c.overflow;
  w.first_bad_token = c.first_bad == ULLONG_MAX ? -1 : static_cast<int64_t>(c.first_bad);
  w.bad_page_pairs = c.bad_pages;
  return w;
}

Status DeviceLayer::CopyBlocks(const int32_t* pairs, size_t n, void* stream) {
  if (!impl_->has_planes) return FailedPreconditionError("CopyBlocks: the layer has no planes (BorrowPlanes)");
  if (n == 0) return Status::Ok();
  if (pairs == nullptr) return InvalidArgumentError("CopyBlocks: pairs must be a device pointer, got null");
  if (reinterpret_cast<uintptr_t>(pairs) % 4 != 0) return InvalidArgumentError("CopyBlocks: pairs must be 4-byte aligned");
  if (n > 65535u * 1024u) return InvalidArgumentError("CopyBlocks: at most 67,107,840 pairs a call, got " + Str(n));
  const cudaError_t e = detail::LaunchCopyPages(impl_->layer, pairs, static_cast<int>(n),
                                                static_cast<detail::WriteCounters*>(impl_->counters.data()),
                                                static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return CudaError(e, "page copy launch");
  return Status::Ok();
}

Status DeviceLayer::SetMeansFromChunk(const void* k, const void* v, DType dtype, size_t tokens, bool center_keys,
                                      bool center_values, void* stream) {
  if (impl_->written) {
    return FailedPreconditionError(
        "SetMeansFromChunk: pages were already written without these means; set them before the first WriteSlots");
  }
  if (!ValidDtype(dtype)) return InvalidArgumentError("SetMeansFromChunk: dtype must be f32, f16 or bf16");
  if (tokens == 0 || tokens > (size_t{1} << 31)) {
    return InvalidArgumentError("SetMeansFromChunk: tokens must be in 1..2^31, got " + Str(tokens));
  }
  if ((center_keys && k == nullptr) || (center_values && v == nullptr)) {
    return InvalidArgumentError("SetMeansFromChunk: k (when center_keys) and v (when center_values) must be device pointers, got null");
  }
  Layer& L = impl_->layer;
  const size_t hd = static_cast<size_t>(L.H) * L.D;
  if (impl_->means.size() == 0) {
    TQ_ASSIGN_OR_RETURN(impl_->means, DeviceBuffer::Allocate(2 * hd * 4));
  }
  float* km = static_cast<float*>(impl_->means.data());
  float* vm = km + hd;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (center_keys) {
    TQ_CUDA_RETURN(detail::LaunchMeans(k, DtypeCode(dtype), static_cast<long long>(tokens), L.H, L.D, km, st),
                   "key means launch");
  }
  if (center_values) {
    TQ_CUDA_RETURN(detail::LaunchMeans(v, DtypeCode(dtype), static_cast<long long>(tokens), L.H, L.D, vm, st),
                   "value means launch");
  }
  L.k.mean = center_keys ? km : nullptr;
  L.v.mean = center_values ? vm : nullptr;
  return Status::Ok();
}

Status DeviceLayer::GetMeans(std::vector<float>* key_mean, std::vector<float>* value_mean) const {
  const Layer& L = impl_->layer;
  const size_t hd = static_cast<size_t>(L.H) * L.D;
  TQ_CUDA_RETURN(cudaDeviceSynchronize(), "synchronize before reading the means");
  for (int c = 0; c < 2; ++c) {
    std::vector<float>* out = c == 0 ? key_mean : value_mean;
    const float* src = c == 0 ? L.k.mean : L.v.mean;
    if (out == nullptr) continue;
    out->clear();
    if (src == nullptr) continue;
    out->resize(hd);
    TQ_CUDA_RETURN(cudaMemcpy(out->data(), src, hd * 4, cudaMemcpyDeviceToHost), "copy means to host");
  }
  return Status::Ok();
}

namespace {
// The checks PagedDecode and PagedExtend share once their plan matched:
// the workspace (size, 256-byte alignment), q (16-byte alignment), block
// tables that hold max_seq_len, the window, and the scale (resolved into
// `scale`: 0 means 1/sqrt(head_dim)). Errors are prefixed with `who`.
Status CheckCall(const char* who, const Layer& L, size_t workspace_needed, const void* workspace,
                 size_t workspace_bytes, const void* q, size_t max_blocks_per_seq, size_t max_seq_len,
                 size_t window, float scale_in, float* scale) {
  const std::string w = who;
  if (workspace_bytes < workspace_needed) {
    return InvalidArgumentError(w + ": workspace has " + Str(workspace_bytes) + " bytes, needs " +
                                Str(workspace_needed));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0 || reinterpret_cast<uintptr_t>(q) % 16 != 0) {
    return InvalidArgumentError(w + ": workspace must be 256-byte aligned and q 16-byte aligned");
  }
  if (max_blocks_per_seq == 0 || max_blocks_per_seq * static_cast<size_t>(L.block_size) < max_seq_len ||
      max_blocks_per_seq > INT_MAX) {
    return InvalidArgumentError(w + ": max_blocks_per_seq (" + Str(max_blocks_per_seq) + ") pages of " +
                                Str(L.block_size) + " tokens must hold max_seq_len (" + Str(max_seq_len) + ")");
  }
  if (window > INT_MAX) return InvalidArgumentError(w + ": window too large");
  *scale = scale_in > 0.f ? scale_in : 1.0f / std::sqrt(static_cast<float>(L.D));
  if (!std::isfinite(*scale)) return InvalidArgumentError(w + ": scale must be finite");
  return Status::Ok();
}

// Launches a decode whose arguments and plan were checked (PagedDecode, or
// PagedExtend's one-token route); `scale` is resolved.
Status LaunchDecodeCall(const Layer& L, const DecodeArgs& a, const DecodePlan& plan, float scale, void* stream) {
  detail::DecodeShape s;
  s.batch = static_cast<int>(a.batch);
  s.hq = static_cast<int>(a.num_q_heads);
  s.group = static_cast<int>(a.num_q_heads / L.H);
  s.max_blocks = static_cast<int>(a.max_blocks_per_seq);
  s.splits = static_cast<int>(plan.splits);
  s.tokens_per_split = static_cast<int>(plan.tokens_per_split);
  s.window = static_cast<int>(a.window);
  s.scale_log2 = scale * 1.4426950408889634f;
  const cudaError_t e = detail::LaunchDecode(L, s, a.q, DtypeCode(a.q_dtype), a.out, DtypeCode(a.out_dtype),
                                             a.block_tables, a.seq_lens, a.workspace,
                                             static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return CudaError(e, "decode launch");
  return Status::Ok();
}

// Decode's split-KV grid in whole waves among splits of at least
// 256 tokens (64-token multiples), the fewest waves x tokens per split,
// counting 64 tokens of fixed cost a CTA; ties go to fewer splits.
void ChooseSplits(size_t ctas, size_t capacity, size_t max_seq_len, size_t* splits, size_t* tps) {
  const size_t max_splits = std::min<size_t>(std::max<size_t>(1, (max_seq_len + 255) / 256), 4096);
  size_t best = SIZE_MAX;
  *splits = 1;
  *tps = (max_seq_len + 63) / 64 * 64;
  for (size_t cand = 1; cand <= max_splits; ++cand) {
    const size_t t = ((max_seq_len + cand - 1) / cand + 63) / 64 * 64;
    const size_t sp = (max_seq_len + t - 1) / t;
    const size_t waves = (ctas * sp + capacity - 1) / capacity;
    const size_t cost = waves * (t + 64);
    if (cost < best) {
      best = cost;
      *splits = sp;
      *tps = t;
    }
  }
}
}  // namespace

Result<DecodePlan> DeviceLayer::PlanDecode(size_t batch, size_t num_q_heads, size_t max_seq_len) const {
  const Layer& L = impl_->layer;
  if (batch == 0 || batch > 65535) return InvalidArgumentError("PlanDecode: batch must be in 1..65535, got " + Str(batch));
  if (num_q_heads == 0 || num_q_heads % L.H != 0 || num_q_heads / L.H > 8) {
    return InvalidArgumentError("PlanDecode: num_q_heads (" + Str(num_q_heads) + ") must be a multiple of the " +
                                Str(L.H) + " KV heads, with 1..8 query heads per KV head");
  }
  if (max_seq_len == 0 || max_seq_len > (size_t{1} << 30)) {
    return InvalidArgumentError("PlanDecode: max_seq_len must be in 1..2^30, got " + Str(max_seq_len));
  }
  // Split-KV grid in whole waves: a grid of pairs x splits CTAs runs in
  // ceil(CTAs / (SMs x CTAs per SM)) waves, each as long as one split, so a
  // grid just above a wave takes twice as long as one just below it (first
  // measured on the H200: 640 CTAs of 4 per SM on 132 SMs = 1.21 waves).
  const size_t pairs = batch * static_cast<size_t>(L.H);
  int per_sm = 0;
  TQ_CUDA_RETURN(detail::DecodeBlocksPerSm(L, static_cast<int>(num_q_heads / L.H), &per_sm),
                 "PlanDecode: occupancy of the decode kernel");
  const size_t capacity = static_cast<size_t>(std::max(impl_->sm_count, 1)) * static_cast<size_t>(std::max(per_sm, 1));
  size_t splits = 1, tps = 0;
  ChooseSplits(pairs, capacity, max_seq_len, &splits, &tps);
  DecodePlan p;
  p.splits = splits;
  p.tokens_per_split = tps;
  detail::DecodeShape s;
  s.batch = static_cast<int>(batch);
  s.hq = static_cast<int>(num_q_heads);
  s.splits = static_cast<int>(splits);
  p.workspace_bytes = detail::DecodeWorkspaceBytes(s, L.D);
  return p;
}

Status DeviceLayer::PagedDecode(const DecodeArgs& a, void* stream) const {
  const Layer& L = impl_->layer;
  if (!impl_->has_planes) return FailedPreconditionError("PagedDecode: the layer has no planes (BorrowPlanes)");
  if (a.plan == nullptr) return InvalidArgumentError("PagedDecode: args.plan is required (PlanDecode)");
  if (!ValidDtype(a.q_dtype) || !ValidDtype(a.out_dtype)) {
    return InvalidArgumentError("PagedDecode: q and out dtypes must be f32, f16 or bf16");
  }
  if (a.q == nullptr || a.out == nullptr || a.block_tables == nullptr || a.seq_lens == nullptr ||
      a.workspace == nullptr) {
    return InvalidArgumentError("PagedDecode: q, out, block_tables, seq_lens and workspace must be device pointers, got null");
  }
  Result<DecodePlan> want = PlanDecode(a.batch, a.num_q_heads, a.max_seq_len);
  if (!want.ok()) return want.status();
  if (want->splits != a.plan->splits || want->tokens_per_split != a.plan->tokens_per_split) {
    return InvalidArgumentError("PagedDecode: the plan was made for another shape; call PlanDecode(batch, num_q_heads, max_seq_len)");
  }
  float scale = 0.f;
  TQ_RETURN_IF_ERROR(CheckCall("PagedDecode", L, want->workspace_bytes, a.workspace, a.workspace_bytes, a.q,
                               a.max_blocks_per_seq, a.max_seq_len, a.window, a.scale, &scale));
  return LaunchDecodeCall(L, a, *a.plan, scale, stream);
}

const char* ExtendKernelName(ExtendKernel k) {
  switch (k) {
    case ExtendKernel::kAuto: return "auto";
    case ExtendKernel::kNarrow: return "narrow";
    case ExtendKernel::kTile: return "tile";
  }
  return "unknown";
}

// The extend plan's split rule, a knob for A/B builds (-DTQ_EXTEND_WAVE_SPLITS=1
// in CMAKE_CUDA_FLAGS): 0 = as many splits as fit one wave (measured, the
// default); 1 = splits in whole waves, as PlanDecode counts them.
#ifndef TQ_EXTEND_WAVE_SPLITS
#define TQ_EXTEND_WAVE_SPLITS 0
#endif

namespace {
// Where the narrow kernel applies (block sizes that are multiples of 16),
// whether kAuto takes it for `rows` query rows a KV head (max_q_len x GQA),
// from the H100 timings in docs/BENCHMARKS.md (CUDA extend): the narrow
// kernel was as fast or faster everywhere (16 rows: 2.2-3.3x; 128 to 8,192
// rows: within 1.2% or up to 1.3x) except with 2/3-bit TurboQuant keys at
// 17-64 rows, where its one split of 2-4 column blocks a head fills the GPU
// in 1.3 waves and the tile kernel's split grid ran 1.04-1.22x faster.
bool AutoNarrow(const Layer& L, size_t rows) {
  const bool low_bit_keys = L.k.kind == detail::kCompTq && L.k.bits <= 3;
  return !(low_bit_keys && rows > 16 && rows <= 64);
}
}  // namespace

Result<ExtendPlan> DeviceLayer::PlanExtend(size_t batch, size_t num_q_heads, size_t total_q, size_t max_q_len,
                                           size_t max_seq_len, ExtendKernel kernel) const {
  const Layer& L = impl_->layer;
  if (batch == 0 || batch > 65535) return InvalidArgumentError("PlanExtend: batch must be in 1..65535, got " + Str(batch));
  if (num_q_heads == 0 || num_q_heads % L.H != 0 || num_q_heads / L.H > 8) {
    return InvalidArgumentError("PlanExtend: num_q_heads (" + Str(num_q_heads) + ") must be a multiple of the " +
                                Str(L.H) + " KV heads, with 1..8 query heads per KV head");
  }
  if (max_seq_len == 0 || max_seq_len > (size_t{1} << 30)) {
    return InvalidArgumentError("PlanExtend: max_seq_len must be in 1..2^30, got " + Str(max_seq_len));
  }
  if (max_q_len == 0 || max_q_len > max_seq_len) {
    return InvalidArgumentError("PlanExtend: max_q_len must be in 1..max_seq_len (" + Str(max_seq_len) + "), got " +
                                Str(max_q_len));
  }
  if (total_q < max_q_len || total_q > batch * max_q_len || total_q * num_q_heads > (size_t{1} << 31) / 256) {
    return InvalidArgumentError("PlanExtend: total_q (" + Str(total_q) + ") must be in max_q_len.." +
                                "batch x max_q_len (" + Str(max_q_len) + ".." + Str(batch * max_q_len) +
                                ") with total_q x num_q_heads below 2^23");
  }
  const int kernel_code = static_cast<int>(kernel);
  if (kernel_code < 0 || kernel_code > 2) {
    return InvalidArgumentError("PlanExtend: kernel must be kAuto, kNarrow or kTile, got " + std::to_string(kernel_code));
  }
  const bool narrow_fits = L.block_size % 16 == 0;
  if (kernel == ExtendKernel::kNarrow && !narrow_fits) {
    return InvalidArgumentError("PlanExtend: the narrow kernel needs a block size that is a multiple of 16, got " +
                                Str(L.block_size) + " (use kAuto or kTile)");
  }
  const size_t group = num_q_heads / L.H;
  ExtendPlan p;
  const size_t rows = max_q_len * group;
  const bool narrow = kernel == ExtendKernel::kNarrow || (kernel == ExtendKernel::kAuto && narrow_fits && AutoNarrow(L, rows));
  p.kernel = narrow ? ExtendKernel::kNarrow : ExtendKernel::kTile;
  int per_sm = 0;
  if (narrow) {
    // 16 rows a CTA (two n-tiles) where they fill it, 8 otherwise and at
    // head_dim 256 (the accumulators of 16 would not fit the registers).
    p.rows_per_cta = rows <= 8 || L.D == 256 ? 8 : 16;
    p.q_tiles = (rows + p.rows_per_cta - 1) / p.rows_per_cta;
    TQ_CUDA_RETURN(detail::NarrowBlocksPerSm(L, static_cast<int>(p.rows_per_cta / 8), &per_sm),
                   "PlanExtend: occupancy of the narrow extend kernel");
  } else {
    const int wn = rows <= 16 ? 4 : rows <= 32 ? 2 : 1;
    p.rows_per_cta = 64 / static_cast<size_t>(wn);
    const size_t tokens_per_cta = p.rows_per_cta / group;
    p.q_tiles = (max_q_len + tokens_per_cta - 1) / tokens_per_cta;
    TQ_CUDA_RETURN(detail::ExtendBlocksPerSm(L, wn, &per_sm), "PlanExtend: occupancy of the extend kernel");
  }
  if (per_sm == 0) return InternalError("PlanExtend: the extend kernel does not fit a multiprocessor");
  const size_t capacity = static_cast<size_t>(std::max(impl_->sm_count, 1)) * static_cast<size_t>(per_sm);
  // Splits only while the query tiles leave the GPU idle (few query rows:
  // speculative verification, short chunks): as many as fit one wave (a
  // partial second wave would double the time), with at least 256 tokens a
  // split. From 256 x that many tokens of history on, the splits, and with
  // them the workspace, no longer depend on it.
  const size_t ctas = p.q_tiles * L.H * batch;
  size_t splits = std::max<size_t>(1, capacity / ctas);
#if TQ_EXTEND_WAVE_SPLITS
  // Candidate rule for an A/B build (not measured): splits in whole waves,
  // time ~ ceil(ctas x splits / capacity) / splits, the fewest splits within
  // 2% of the best up to max(2, 4 x capacity / ctas).
  {
    const size_t max_splits = std::max<size_t>(2, (4 * capacity + ctas - 1) / ctas);
    auto wave_cost = [&](size_t sp) {
      return static_cast<double>((ctas * sp + capacity - 1) / capacity) / static_cast<double>(sp);
    };
    double best = wave_cost(1);
    for (size_t sp = 2; sp <= max_splits; ++sp) best = std::min(best, wave_cost(sp));
    splits = 1;
    while (wave_cost(splits) > 1.02 * best) ++splits;
  }
#endif
  splits = std::min(splits, std::max<size_t>(1, (max_seq_len + 255) / 256));
  p.tokens_per_split = ((max_seq_len + splits - 1) / splits + 63) / 64 * 64;
  p.splits = (max_seq_len + p.tokens_per_split - 1) / p.tokens_per_split;
  detail::ExtendShape s;
  s.total_q = static_cast<int>(total_q);
  s.hq = static_cast<int>(num_q_heads);
  s.splits = static_cast<int>(p.splits);
  p.workspace_bytes = detail::ExtendWorkspaceBytes(s, L.D);
  if (kernel == ExtendKernel::kAuto && max_q_len == 1 && total_q == batch) {
    TQ_ASSIGN_OR_RETURN(p.decode, PlanDecode(batch, num_q_heads, max_seq_len));
    p.decode_route = true;
    p.workspace_bytes = std::max(p.workspace_bytes, p.decode.workspace_bytes);
  }
  return p;
}

Status DeviceLayer::PagedExtend(const ExtendArgs& a, void* stream) const {
  const Layer& L = impl_->layer;
  if (!impl_->has_planes) return FailedPreconditionError("PagedExtend: the layer has no planes (BorrowPlanes)");
  if (a.plan == nullptr) return InvalidArgumentError("PagedExtend: args.plan is required (PlanExtend)");
  if (!ValidDtype(a.q_dtype) || !ValidDtype(a.out_dtype)) {
    return InvalidArgumentError("PagedExtend: q and out dtypes must be f32, f16 or bf16");
  }
  if (a.q == nullptr || a.out == nullptr || a.cu_seqlens_q == nullptr || a.block_tables == nullptr ||
      a.seq_lens == nullptr || a.workspace == nullptr) {
    return InvalidArgumentError(
        "PagedExtend: q, out, cu_seqlens_q, block_tables, seq_lens and workspace must be device pointers, got null");
  }
  // The plan's kernel was kAuto's choice, or forced: re-planning with the
  // choice itself gives the same plan (the decode route only comes from kAuto).
  Result<ExtendPlan> want = PlanExtend(a.batch, a.num_q_heads, a.total_q, a.max_q_len, a.max_seq_len,
                                       a.plan->decode_route ? ExtendKernel::kAuto : a.plan->kernel);
  if (!want.ok()) return want.status();
  if (want->kernel != a.plan->kernel || want->splits != a.plan->splits ||
      want->tokens_per_split != a.plan->tokens_per_split ||
      want->q_tiles != a.plan->q_tiles || want->rows_per_cta != a.plan->rows_per_cta ||
      want->decode_route != a.plan->decode_route || want->decode.splits != a.plan->decode.splits ||
      want->decode.tokens_per_split != a.plan->decode.tokens_per_split) {
    return InvalidArgumentError(
        "PagedExtend: the plan was made for another shape; call PlanExtend(batch, num_q_heads, total_q, max_q_len, "
        "max_seq_len)");
  }
  float scale = 0.f;
  TQ_RETURN_IF_ERROR(CheckCall("PagedExtend", L, want->workspace_bytes, a.workspace, a.workspace_bytes, a.q,
                               a.max_blocks_per_seq, a.max_seq_len, a.window, a.scale, &scale));
  if (!(a.softcap >= 0.f) || !std::isfinite(a.softcap)) {
    return InvalidArgumentError("PagedExtend: softcap must be finite and >= 0 (0 = off)");
  }
  if (a.softcap > 0.f && L.k.mean != nullptr) {
    // Centered keys drop q·mean from every logit of a query (softmax-
    // invariant), which the soft-cap's tanh is not.
    return UnimplementedError("PagedExtend: soft-cap with key means is not supported; use a cache without key means");
  }
  if (a.plan->decode_route && a.softcap == 0.f) {  // one query a sequence: rows b of q are sequence b's
    DecodeArgs d;
    d.q = a.q;
    d.q_dtype = a.q_dtype;
    d.out = a.out;
    d.out_dtype = a.out_dtype;
    d.batch = a.batch;
    d.num_q_heads = a.num_q_heads;
    d.block_tables = a.block_tables;
    d.max_blocks_per_seq = a.max_blocks_per_seq;
    d.seq_lens = a.seq_lens;
    d.max_seq_len = a.max_seq_len;
    d.window = a.window;
    d.workspace = a.workspace;
    return LaunchDecodeCall(L, d, a.plan->decode, scale, stream);
  }
  detail::ExtendShape s;
  s.batch = static_cast<int>(a.batch);
  s.hq = static_cast<int>(a.num_q_heads);
  s.group = static_cast<int>(a.num_q_heads / L.H);
  s.max_blocks = static_cast<int>(a.max_blocks_per_seq);
  s.total_q = static_cast<int>(a.total_q);
  if (a.plan->kernel == ExtendKernel::kNarrow) {
    s.narrow = 1;
    s.cols_per_cta = static_cast<int>(a.plan->rows_per_cta);
    s.col_blocks = static_cast<int>(a.plan->q_tiles);
  } else {
    s.wn = static_cast<int>(64 / a.plan->rows_per_cta);
    s.tokens_per_cta = static_cast<int>(a.plan->rows_per_cta) / s.group;
    s.q_tiles = static_cast<int>(a.plan->q_tiles);
  }
  s.splits = static_cast<int>(a.plan->splits);
  s.tokens_per_split = static_cast<int>(a.plan->tokens_per_split);
  s.window = static_cast<int>(a.window);
  s.scale_log2 = scale * 1.4426950408889634f;
  s.softcap_log2 = a.softcap * 1.4426950408889634f;
  const cudaError_t e = detail::LaunchExtend(L, s, a.q, DtypeCode(a.q_dtype), a.out, DtypeCode(a.out_dtype),
                                             a.cu_seqlens_q, a.block_tables, a.seq_lens, a.workspace,
                                             static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return CudaError(e, "extend launch");
  return Status::Ok();
}

namespace {
Status CheckSameGeometry(const DeviceLayer::Impl& d, const PagedLayerView& v) {
  const Layer& L = d.layer;
  if (v.num_blocks != d.num_blocks || v.block_size != static_cast<size_t>(L.block_size) ||
      v.num_kv_heads != static_cast<size_t>(L.H) || v.head_dim != static_cast<size_t>(L.D) ||
      ToString(v.k.codecs[0]->format()) != ToString(d.kfmt) || ToString(v.v.codecs[0]->format()) != ToString(d.vfmt)) {
    return InvalidArgumentError("host and device layers differ in pool size, block size, heads, head_dim or formats");
  }
  return Status::Ok();
}
}  // namespace

Status DeviceLayer::CopyToHost(PagedKVCache& host, size_t layer) const {
  TQ_ASSIGN_OR_RETURN(PagedLayerView v, host.View(layer));
  TQ_RETURN_IF_ERROR(CheckSameGeometry(*impl_, v));
  TQ_ASSIGN_OR_RETURN(PagedKVCache::RawPlanes r, host.MutablePlanes(layer));
  const Layer& L = impl_->layer;
  const PlaneBytes& b = impl_->bytes;
  TQ_CUDA_RETURN(cudaMemcpy(r.k_codes, L.k.codes, b.k_codes, cudaMemcpyDeviceToHost), "copy K codes");
  if (b.k_meta) TQ_CUDA_RETURN(cudaMemcpy(r.k_meta, L.k.meta, b.k_meta, cudaMemcpyDeviceToHost), "copy K meta");
  TQ_CUDA_RETURN(cudaMemcpy(r.v_codes, L.v.codes, b.v_codes, cudaMemcpyDeviceToHost), "copy V codes");
  if (b.v_meta) TQ_CUDA_RETURN(cudaMemcpy(r.v_meta, L.v.meta, b.v_meta, cudaMemcpyDeviceToHost), "copy V meta");
  return Status::Ok();
}

Status DeviceLayer::CopyFromHost(const PagedKVCache& host, size_t layer) {
  TQ_ASSIGN_OR_RETURN(PagedLayerView v, host.View(layer));
  TQ_RETURN_IF_ERROR(CheckSameGeometry(*impl_, v));
  const Layer& L = impl_->layer;
  const PlaneBytes& b = impl_->bytes;
  TQ_CUDA_RETURN(cudaMemcpy(L.k.codes, v.k.codes, b.k_codes, cudaMemcpyHostToDevice), "copy K codes");
  if (b.k_meta) TQ_CUDA_RETURN(cudaMemcpy(L.k.meta, v.k.meta, b.k_meta, cudaMemcpyHostToDevice), "copy K meta");
  TQ_CUDA_RETURN(cudaMemcpy(L.v.codes, v.v.codes, b.v_codes, cudaMemcpyHostToDevice), "copy V codes");
  if (b.v_meta) TQ_CUDA_RETURN(cudaMemcpy(L.v.meta, v.v.meta, b.v_meta, cudaMemcpyHostToDevice), "copy V meta");
  return Status::Ok();
}

}  // namespace tq::cuda
