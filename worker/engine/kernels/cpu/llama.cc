// The Llama ops: nn.Linear-layout linear layers, RMSNorm, rotary position embeddings, SwiGLU.
//
// Letters: n rows (b·t tokens), c channels, t chunk length, d head dimension, f MLP width.
// Forward/backward pairs as in kernels.h: weight gradients accumulate, input gradients say
// whether they overwrite or accumulate. Row loops are split over the calling thread's OpenMP
// team (blas.h, "Threads"), sums over rows by column strips: one-thread results, bit for bit.
#include <omp.h>

#include <cmath>
#include <vector>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/fast_exp.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {

// ---------------------------------------------------------------------------------------------
// Linear, weight [out, in]: the checkpoint layout of LlamaForCausalLM, so export is a memcpy.

void LinearTForward(float* out, const float* inp, const float* weight, int n, int in_dim,
                    int out_dim) {
  Gemm(false, true, n, out_dim, in_dim, 1.0f, inp, in_dim, weight, in_dim, 0.0f, out, out_dim);
}

void LinearTBackwardInput(float* dinp, const float* dout, const float* weight, int n, int in_dim,
                          int out_dim) {
  Gemm(false, false, n, in_dim, out_dim, 1.0f, dout, out_dim, weight, in_dim, 0.0f, dinp, in_dim);
}

void LinearTBackwardWeight(float* dweight, const float* dout, const float* inp, int n, int in_dim,
                           int out_dim) {
  Gemm(true, false, out_dim, in_dim, n, 1.0f, dout, out_dim, inp, in_dim, 1.0f, dweight, in_dim);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm.

void RmsNormForward(float* out, float* rstd, const float* inp, const float* weight, int n, int c,
                    float eps) {
  const long work = static_cast<long>(n) * c;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
  for (int i = 0; i < n; ++i) {
    const float* x = inp + static_cast<long>(i) * c;
    float* y = out + static_cast<long>(i) * c;
    double ss = 0.0;  // double: the statistic is cheap and stays independent of c
    for (int j = 0; j < c; ++j) ss += static_cast<double>(x[j]) * x[j];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / c + eps));
    for (int j = 0; j < c; ++j) y[j] = x[j] * r * weight[j];
    rstd[i] = r;
  }
}

void RmsNormBackwardInput(float* dinp, const float* dout, const float* inp, const float* weight,
                          const float* rstd, int n, int c) {
  const long work = static_cast<long>(n) * c;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
  for (int i = 0; i < n; ++i) {
    const float* dy = dout + static_cast<long>(i) * c;
    const float* x = inp + static_cast<long>(i) * c;
    float* dx = dinp + static_cast<long>(i) * c;
    const float r = rstd[i];
    // y_j = w_j·x_j·r with r = (mean(x²)+eps)^(-1/2), so ∂r/∂x_k = −r³·x_k/c and
    // dx_k = r·g_k − x̂_k·mean(g·x̂), g = dy·w, x̂ = x·r.
    double dot = 0.0;
    for (int j = 0; j < c; ++j) dot += static_cast<double>(dy[j] * weight[j]) * (x[j] * r);
    const float m = static_cast<float>(dot / c);
    for (int j = 0; j < c; ++j) dx[j] += r * (dy[j] * weight[j] - x[j] * r * m);
  }
}

void RmsNormBackwardWeight(float* dweight, const float* dout, const float* inp, const float* rstd,
                           int n, int c) {
  const long work = static_cast<long>(n) * c;
#pragma omp parallel if (work >= kParallelMinWork)
  {
    int j0, j1;
    ColumnStrip(c, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);
    for (int i = 0; i < n; ++i) {
      const float* dy = dout + static_cast<long>(i) * c;
      const float* x = inp + static_cast<long>(i) * c;
      const float r = rstd[i];
      for (int j = j0; j < j1; ++j) dweight[j] += dy[j] * (x[j] * r);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding.

namespace {

// Rotates pairs (i, i + d/2) of every head of every row by sign · pos · theta^(−2i/d).
// Angles are formed in double, then cos/sin rounded to float once: at positions in the
// thousands an fp32 product pos·freq would already be off by several ulps of the angle.
void Rotate(float* x, int ld, int batch, int t, int heads, int d, int start_pos, float theta,
            float sign) {
  const int half = d / 2;
  std::vector<float> cs(static_cast<size_t>(t) * half), sn(cs.size());  // (t, d/2)
  // pow, cos and sin in double cost more than the rotation itself (an entry weighs about 16
  // floats of a row loop): split them over the team too.
  const long work = static_cast<long>(t) * half * 16;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
  for (int j = 0; j < t; ++j) {
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(static_cast<double>(theta), -2.0 * i / d);
      const double angle = static_cast<double>(start_pos + j) * inv_freq;
      cs[static_cast<size_t>(j) * half + i] = static_cast<float>(std::cos(angle));
      sn[static_cast<size_t>(j) * half + i] = sign * static_cast<float>(std::sin(angle));
    }
  }
  const long rows = static_cast<long>(batch) * t;
#pragma omp parallel for schedule(static) if (rows * heads * d >= kParallelMinWork)
  for (long r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    const float* c = cs.data() + static_cast<size_t>(r % t) * half;
    const float* s = sn.data() + static_cast<size_t>(r % t) * half;
    for (int h = 0; h < heads; ++h) {
      float* v = row + static_cast<long>(h) * d;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b2 = v[i + half];
        v[i] = a * c[i] - b2 * s[i];
        v[i + half] = b2 * c[i] + a * s[i];
      }
    }
  }
}

}  // namespace

void RopeForward(float* x, int ld, int batch, int t, int heads, int head_dim, int start_pos,
                 float theta) {
  Rotate(x, ld, batch, t, heads, head_dim, start_pos, theta, 1.0f);
}

void RopeBackward(float* dx, int ld, int batch, int t, int heads, int head_dim, int start_pos,
                  float theta) {
  // y = R·x with R orthogonal, so dx = Rᵀ·dy: the rotation by the opposite angle.
  Rotate(dx, ld, batch, t, heads, head_dim, start_pos, theta, -1.0f);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU.

namespace {
// One token's SwiGLU, forward and backward (parallel.h: VP_ALSO_AVX512).
VP_ALSO_AVX512 void SwigluForwardRow(float* o,        // (f)
                                     const float* g,  // (f) gate
                                     const float* u,  // (f) up
                                     int f) {
  for (int j = 0; j < f; ++j) o[j] = g[j] * Sigmoid(g[j]) * u[j];
}

VP_ALSO_AVX512 void SwigluBackwardRow(float* dg, float* du,  // (f) each, overwritten
                                      const float* g, const float* u, const float* dy, int f) {
  for (int j = 0; j < f; ++j) {
    const float sig = Sigmoid(g[j]);
    const float silu = g[j] * sig;
    dg[j] = dy[j] * u[j] * sig * (1.0f + g[j] * (1.0f - sig));
    du[j] = dy[j] * silu;
  }
}

}  // namespace

void SwigluForward(float* out, const float* gu, long n, int f) {
#pragma omp parallel for schedule(static) if (n * f >= kParallelMinWork)
  for (long r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    float* o = out + r * f;
    SwigluForwardRow(o, g, u, f);
  }
}

void SwigluBackward(float* dgu, const float* gu, const float* dout, long n, int f) {
#pragma omp parallel for schedule(static) if (n * f >= kParallelMinWork)
  for (long r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    const float* dy = dout + r * f;
    float* dg = dgu + r * 2 * f;
    float* du = dg + f;
    SwigluBackwardRow(dg, du, g, u, dy, f);
  }
}

}  // namespace vp::engine::cpu
