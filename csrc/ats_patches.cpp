// Native patch extraction for ats (issue 6): the forward gather and its backward
// scatter-add, for CPU (measured, see csrc/README.md) and, when built with
// -DATS_WITH_CUDA, CUDA (ats_patches_cuda.cu). Semantics are those of the torch path in
// ats_cli/core/patches.py, which the tests compare against bit for bit: patches
// [B, n, C, h, w] of images [B, C, H, W] whose top-left corners are offsets [B, n, 2]
// (row, col), zeros outside the image, any input strides (NCHW or channels-last).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "ats_patches.h"

namespace {

void check_inputs(const at::Tensor& images, const at::Tensor& offsets) {
  TORCH_CHECK(images.dim() == 4, "images must be [B, C, H, W], got ", images.sizes());
  TORCH_CHECK(offsets.dim() == 3 && offsets.size(0) == images.size(0) && offsets.size(2) == 2,
              "offsets must be [B, n, 2], got ", offsets.sizes());
  TORCH_CHECK(offsets.scalar_type() == at::kLong, "offsets must be int64");
  TORCH_CHECK(offsets.device() == images.device(), "offsets and images must be on the same device");
}

// A channels-last image gets a channels-last output ([B, n, h, w, C] in memory), so that
// reads and writes both run along the contiguous axis.
bool wants_channels_last(const at::Tensor& images) {
  return images.size(1) > 1 && !images.is_contiguous() &&
         images.is_contiguous(at::MemoryFormat::ChannelsLast);
}

template <typename T>
void extract_cpu(const T* img, const int64_t* off, T* out, const ats::Geometry& g) {
  // One task per (image, patch): they write disjoint outputs, so no synchronisation.
  at::parallel_for(0, g.B * g.n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = p / g.n, r0 = off[2 * p], c0 = off[2 * p + 1];
      const int64_t x0 = std::clamp<int64_t>(-c0, 0, g.w), x1 = std::clamp<int64_t>(g.W - c0, x0, g.w);
      const T* base = img + b * g.sB;
      for (int64_t y = 0; y < g.h; ++y) {
        const int64_t row = r0 + y;
        const bool row_in = row >= 0 && row < g.H;
        for (int64_t c = 0; c < g.C; ++c) {
          const T* src = base + c * g.sC + row * g.sH + c0 * g.sW;
          for (int64_t x = 0; x < g.w; ++x) {
            const int64_t o = g.channels_last ? (((p * g.h + y) * g.w + x) * g.C + c)
                                              : (((p * g.C + c) * g.h + y) * g.w + x);
            out[o] = (row_in && x >= x0 && x < x1) ? src[x * g.sW] : T(0);
          }
        }
      }
    }
  });
}

template <typename T>
void scatter_cpu(const T* grad, const int64_t* off, T* gimg, const ats::Geometry& g) {
  // Patches of one image may overlap, patches of different images never do: parallel
  // over images, sequential within one, hence no race and a deterministic sum.
  at::parallel_for(0, g.B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t k = 0; k < g.n; ++k) {
        const int64_t p = b * g.n + k, r0 = off[2 * p], c0 = off[2 * p + 1];
        for (int64_t c = 0; c < g.C; ++c) {
          for (int64_t y = 0; y < g.h; ++y) {
            const int64_t row = r0 + y;
            if (row < 0 || row >= g.H) continue;
            for (int64_t x = std::max<int64_t>(0, -c0); x < g.w && c0 + x < g.W; ++x) {
              const int64_t o = g.channels_last ? (((p * g.h + y) * g.w + x) * g.C + c)
                                                : (((p * g.C + c) * g.h + y) * g.w + x);
              gimg[b * g.sB + c * g.sC + row * g.sH + (c0 + x) * g.sW] += grad[o];
            }
          }
        }
      }
    }
  });
}

ats::Geometry geometry(const at::Tensor& images, const at::Tensor& offsets, int64_t h, int64_t w, bool cl) {
  ats::Geometry g;
  g.B = images.size(0); g.C = images.size(1); g.H = images.size(2); g.W = images.size(3);
  g.n = offsets.size(1); g.h = h; g.w = w;
  g.sB = images.stride(0); g.sC = images.stride(1); g.sH = images.stride(2); g.sW = images.stride(3);
  g.channels_last = cl;
  return g;
}

// The output as [B, n, C, h, w], whatever its memory order.
at::Tensor empty_patches(const at::Tensor& images, int64_t n, int64_t h, int64_t w, bool cl) {
  const int64_t B = images.size(0), C = images.size(1);
  if (cl) return at::empty({B, n, h, w, C}, images.options()).permute({0, 1, 4, 2, 3});
  return at::empty({B, n, C, h, w}, images.options());
}

}  // namespace

at::Tensor extract(const at::Tensor& images, const at::Tensor& offsets, int64_t h, int64_t w) {
  check_inputs(images, offsets);
  TORCH_CHECK(h > 0 && w > 0, "patch size must be positive");
  const auto off = offsets.contiguous();
  const bool cl = wants_channels_last(images);
  auto out = empty_patches(images, off.size(1), h, w, cl);
  const auto g = geometry(images, off, h, w, cl);
  if (out.numel() == 0) return out;
#ifdef ATS_WITH_CUDA
  if (images.is_cuda()) {
    ats::extract_cuda(images, off, out, g);
    return out;
  }
#endif
  TORCH_CHECK(images.device().is_cpu(), "ats_patches was built without CUDA; got a tensor on ", images.device());
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, images.scalar_type(), "ats_extract_cpu", [&] {
    extract_cpu<scalar_t>(images.const_data_ptr<scalar_t>(), off.const_data_ptr<int64_t>(),
                          out.mutable_data_ptr<scalar_t>(), g);
  });
  return out;
}

// Gradient w.r.t. the image: the adjoint of extract, a scatter-add of grad [B, n, C, h, w].
at::Tensor scatter(const at::Tensor& grad, const at::Tensor& offsets, int64_t H, int64_t W) {
  TORCH_CHECK(grad.dim() == 5, "grad must be [B, n, C, h, w], got ", grad.sizes());
  const int64_t B = grad.size(0), C = grad.size(2), h = grad.size(3), w = grad.size(4);
  auto gimg = at::zeros({B, C, H, W}, grad.options());
  check_inputs(gimg, offsets);
  const auto off = offsets.contiguous();
  // Read grad in whichever order it is already laid out in (no copy in the common case).
  const bool cl = C > 1 && !grad.is_contiguous() && grad.permute({0, 1, 3, 4, 2}).is_contiguous();
  const auto g_in = cl ? grad : grad.contiguous();
  const auto g = geometry(gimg, off, h, w, cl);
  if (grad.numel() == 0) return gimg;
#ifdef ATS_WITH_CUDA
  if (grad.is_cuda()) {
    ats::scatter_cuda(g_in, off, gimg, g);
    return gimg;
  }
#endif
  TORCH_CHECK(grad.device().is_cpu(), "ats_patches was built without CUDA; got a tensor on ", grad.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "ats_scatter_cpu", [&] {
    scatter_cpu<scalar_t>(g_in.const_data_ptr<scalar_t>(), off.const_data_ptr<int64_t>(),
                          gimg.mutable_data_ptr<scalar_t>(), g);
  });
  return gimg;
}

bool with_cuda() {
#ifdef ATS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("extract", &extract, "patches [B,n,C,h,w] of images [B,C,H,W] at offsets [B,n,2]");
  m.def("scatter", &scatter, "adjoint of extract: scatter-add grad [B,n,C,h,w] into a [B,C,H,W] image");
  m.def("with_cuda", &with_cuda, "whether this build has the CUDA kernels");
}
