// flash.cu: FlashAttention kernels written to be read, in the notation of the FlashAttention papers.
//
// Index. Speed from one bench.py run on an NVIDIA H100 80GB HBM3 (docs/benchmarks.md: the command, every
// shape, causal and bf16): FlashAttention's shapes (B*N = 16384, H*d = 2048), N = 4096, non-causal, d = 64 /
// d = 128; fp32 against manual attention in fp32 (TF32 off), fp16 against SDPA's FLASH_ATTENTION backend
// (FlashAttention-2), in the same run.
//   kernel  what it adds                                           GPUs    speed
//   fp32    FA-2 Algorithms 1 and 2 on CUDA cores: a thread block  sm_70+  fwd 1.67x / 1.08x manual,
//           per query block (forward) or key block (backward), each         fwd+bwd 1.21x / 0.79x manual
//           thread owning an 8 x 4 tile of S_ij; dQ by atomics              (35 / 33 TFLOP/s fwd)
//   volta   fp16 forward on mma.m8n8k4: four quad pairs per warp, sm_70+  fwd 0.04x / 0.03x SDPA-flash on
//           operands by plain loads, P_ij through shared memory;           sm_90, which runs m8n8k4 slowly
//           backward: the fp32 kernel on upcast inputs                     (12 / 9 TFLOP/s; no V100 here)
//   turing  fp16 forward on mma.m16n8k8 + ldmatrix, synchronous     sm_75+  fwd 0.64x / 0.46x SDPA-flash on
//           loads, Q_i through the K_j/V_j buffers (64 KB SMs);            sm_90 (191 / 157 TFLOP/s; no T4
//           backward: the fp32 kernel on upcast inputs                     here)
//   ampere  mma.m16n8k16 (fp16/bf16 in, fp32 sums), ldmatrix,      sm_80+  fwd 0.98x / 0.95x SDPA-flash,
//           cp.async double buffering, 32 query rows per warp,             fwd+bwd 0.89x / 0.87x
//           P_ij in registers; backward on transposed products,            (292 / 321 TFLOP/s fwd,
//           8 warps per key block, L_i, D_i staged with Q_i, dO_i,          249 / 267 fwd+bwd)
//           dQ by atomics
//   hopper  wgmma (operands read from shared memory by descriptors,  sm_90a  fwd 1.06x / 1.42x SDPA-flash
//           P_ij from registers), TMA loads by a producer warpgroup        (317 / 481 TFLOP/s; cuDNN 0.71x /
//           into mbarrier stages; forward: two consumer warpgroups         0.81x), fwd+bwd 1.13x / 1.31x
//           taking turns; backward: P and dS through shared memory,       (316 / 403 TFLOP/s; cuDNN 0.74x /
//           overlapped with the previous block's dV_j, dK_j products       0.80x)
//
// Every kernel sits behind one interface (bottom of this file): forward(kernel, Q, K, V, causal, scale)
// returns O and L; backward(kernel, Q, K, V, O, L, dO, causal, scale) returns dQ, dK, dV. Tensors are
// contiguous (B, H, N, d); main.py validates inputs before any launch.
//
// Notation (FlashAttention-2 paper, Algorithms 1 and 2; reference.py is the same algorithm in PyTorch):
//   Q_i (B_r, d)  query block i      K_j, V_j (B_c, d)  key/value block j     T_r, T_c  numbers of blocks
//   S_ij = Q_i K_j^T (B_r, B_c)      P_ij = exp(S_ij - m_i)                   O_i (B_r, d)
//   m_i, l_i (B_r) running row max and sum;  L_i = m_i + log(l_i)  the row log-sum-exp, saved for backward
//   D_i = rowsum(dO_i o O_i);  dS_ij = P_ij o (dP_ij - D_i)
// The softmax runs in base 2: scores are multiplied by scale * log2(e) once, so exp becomes exp2 (one
// MUFU.EX2 instruction) and m_i is kept in those units; L is converted back to natural log on output.
#ifndef __CUDACC_RTC__  // NVRTC compiles the kernels alone (.ci/check_sm70.py: the sm_70 build)
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled (the Hopper kernel's tensor maps)
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

constexpr float LOG2E = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * LOG2E)
constexpr float LN2 = 0.6931471805599453f;     // ln(2):   log(x) = log2(x) * LN2

// Copies a (rows, d) tile of a row-major global matrix into shared memory with row stride ld, filling rows
// at or past N with zeros, so ragged last blocks compute on zeros instead of reading out of bounds.
// 16-byte accesses (4 floats or 8 halves): consecutive threads take consecutive pieces of a row (coalesced).
template <int rows, int d, int n_threads, typename T>
__device__ void load_tile(T* dst, int ld, const T* src, int row0, int N) {
  constexpr int v = 16 / sizeof(T);  // elements per 16-byte piece
  for (int idx = threadIdx.x; idx < rows * d / v; idx += n_threads) {
    const int r = idx / (d / v), c = v * (idx % (d / v));
    uint4 x = make_uint4(0, 0, 0, 0);
    if (row0 + r < N) x = *reinterpret_cast<const uint4*>(&src[(size_t)(row0 + r) * d + c]);
    *reinterpret_cast<uint4*>(&dst[r * ld + c]) = x;
  }
}

// acc[a][b] += sum_k A[(ty*TM + a)*ld + k] * B[(tx + 16*b)*ld + k]   for k < d
// The product X Y^T of two row-major shared tiles, for the 8 x 16 thread layout used by the fp32 kernels:
// thread (ty, tx) owns rows ty*TM + a and columns tx + 16*b. Both operands are read as float4 along k.
// Bank conflicts: a half-warp shares ty, so A reads are broadcasts; B rows tx + 16*b are ld floats apart
// and ld/4 is odd, so the 8 threads served together hit 8 different 16-byte bank groups.
template <int TM, int TN, int d>
__device__ void mma_XYt(float (&acc)[TM][TN], const float* A, const float* B, int ld, int tx, int ty) {
#pragma unroll 4
  for (int k = 0; k < d; k += 4) {
    float4 a[TM], b[TN];
#pragma unroll
    for (int m = 0; m < TM; m++) a[m] = *reinterpret_cast<const float4*>(&A[(ty * TM + m) * ld + k]);
#pragma unroll
    for (int n = 0; n < TN; n++) b[n] = *reinterpret_cast<const float4*>(&B[(tx + 16 * n) * ld + k]);
#pragma unroll
    for (int m = 0; m < TM; m++)
#pragma unroll
      for (int n = 0; n < TN; n++)
        acc[m][n] += a[m].x * b[n].x + a[m].y * b[n].y + a[m].z * b[n].z + a[m].w * b[n].w;
  }
}

// The d/16 columns of a (rows, d) matrix that thread tx owns in O_i, dK_j, dV_j and dQ_i. When d is a
// multiple of 64 they come in runs of 4 neighbours, x = 64*(e/4) + 4*tx + e%4, so one float4 load reads
// a run; otherwise every 16th column, x = 16*e + tx. Either way the 16 threads of a half-warp cover a row.
template <int d>
__device__ int col(int tx, int e) { return d % 64 == 0 ? 64 * (e / 4) + 4 * tx + e % 4 : 16 * e + tx; }

// x[e] = row[col(tx, e)] for e < d/16
template <int d>
__device__ void load_cols(float (&x)[d / 16], const float* row, int tx) {
  if constexpr (d % 64 == 0) {
#pragma unroll
    for (int e = 0; e < d / 16; e += 4) {
      const float4 v = *reinterpret_cast<const float4*>(&row[64 * (e / 4) + 4 * tx]);
      x[e] = v.x, x[e + 1] = v.y, x[e + 2] = v.z, x[e + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < d / 16; e++) x[e] = row[16 * e + tx];
  }
}

// ------------------------------------------------------------------------------------------------------
// fp32 forward: FlashAttention-2, Algorithm 1.
// Grid (T_r, B*H): one block per query block Q_i of one head; heavy causal blocks (large i) start first.
// Block: 128 threads as 8 (ty) x 16 (tx). Thread (ty, tx) owns rows ty*TM .. ty*TM+TM-1 of S_ij and O_i,
// columns tx + 16*n of S_ij (n < TN) and columns col(tx, e) of O_i (e < TX). The 16 threads that share a
// row sit in one half-warp, so row max and row sum are shuffles, never shared memory.
template <int d, int B_r, int B_c>
__global__ void __launch_bounds__(128)
flash_fwd_fp32(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
               float* __restrict__ O, float* __restrict__ L, int N, float scale_log2, bool causal) {
  constexpr int TM = B_r / 8, TN = B_c / 16, TX = d / 16, ld = d + 4, ldP = B_r + 4;
  extern __shared__ float smem[];
  constexpr int KP = B_c * (ld > ldP ? ld : ldP);
  float* Q_s = smem;              // Q_i          (B_r, d)   row stride ld (padding: see mma_XYt)
  float* K_s = Q_s + B_r * ld;    // K_j          (B_c, d)   row stride ld
  float* P_s = K_s;               // P_ij^T       (B_c, B_r) row stride ldP: replaces K_j once S_ij is done,
                                  //              so a block needs less shared memory and 4 fit on an SM
  float* V_s = K_s + KP;          // V_j          (B_c, d)   row stride d
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int i = gridDim.x - 1 - blockIdx.x, row0 = i * B_r;
  const size_t head = (size_t)blockIdx.y * N * d;
  Q += head; K += head; V += head; O += head; L += (size_t)blockIdx.y * N;

  load_tile<B_r, d, 128>(Q_s, ld, Q, row0, N);                             // l.5: load Q_i
  float O_i[TM][TX] = {}, m_i[TM], l_i[TM] = {};                           // l.6: O_i = 0, l_i = 0, m_i = -inf
  for (int m = 0; m < TM; m++) m_i[m] = -INFINITY;

  const int T_c = (N + B_c - 1) / B_c;
  const int j_end = causal ? min(T_c, (row0 + B_r - 1) / B_c + 1) : T_c;  // causal: later blocks all masked
  for (int j = 0; j < j_end; j++) {                                        // l.7: for 1 <= j <= T_c
    __syncthreads();  // every thread is done reading P_s (= K_s) and V_s of block j-1: they are overwritten
    load_tile<B_c, d, 128>(K_s, ld, K, j * B_c, N);                        // l.8: load K_j, V_j
    load_tile<B_c, d, 128>(V_s, d, V, j * B_c, N);
    __syncthreads();  // K_j, V_j (and Q_i on the first pass) are in shared memory before anyone reads them

    float S_ij[TM][TN] = {};                                               // l.9: S_ij = Q_i K_j^T
    mma_XYt<TM, TN, d>(S_ij, Q_s, K_s, ld, tx, ty);
    __syncthreads();  // every thread is done reading K_j: P_ij^T overwrites it below

    for (int m = 0; m < TM; m++) {                                         // l.10: online softmax, row by row
      const int r = row0 + ty * TM + m;
      float rowmax = m_i[m];
      for (int n = 0; n < TN; n++) {
        const int c = j * B_c + tx + 16 * n;  // out-of-range keys and (causal) future keys get -inf
        S_ij[m][n] = (c >= N || (causal && c > r)) ? -INFINITY : S_ij[m][n] * scale_log2;
        rowmax = fmaxf(rowmax, S_ij[m][n]);
      }
      for (int off = 8; off > 0; off /= 2) rowmax = fmaxf(rowmax, __shfl_xor_sync(~0u, rowmax, off));
      // m_i^(j) = max(m_i^(j-1), rowmax(S_ij)) is finite: key 0 is never masked and j = 0 comes first.
      const float alpha = exp2f(m_i[m] - rowmax);                          // e^(m^(j-1) - m^(j))
      float rowsum = 0.f;
      for (int n = 0; n < TN; n++) {
        S_ij[m][n] = exp2f(S_ij[m][n] - rowmax);                           // P_ij = exp(S_ij - m_i^(j))
        rowsum += S_ij[m][n];
      }
      l_i[m] = alpha * l_i[m] + rowsum;  // this thread's share of l_i; the 16 shares are added at the end
      for (int e = 0; e < TX; e++) O_i[m][e] *= alpha;                     // l.11 (first half)
      m_i[m] = rowmax;
    }
    for (int n = 0; n < TN; n++)           // P_ij^T into shared memory, 4 rows of P per 16-byte store
      for (int m = 0; m < TM; m += 4)
        *reinterpret_cast<float4*>(&P_s[(tx + 16 * n) * ldP + ty * TM + m]) =
            make_float4(S_ij[m][n], S_ij[m + 1][n], S_ij[m + 2][n], S_ij[m + 3][n]);
    __syncthreads();  // all of P_ij is written: each thread now reads columns that other threads produced

    for (int c = 0; c < B_c; c++) {                                        // l.11: O_i += P_ij V_j
      float p[TM], v[TX];
      for (int m = 0; m < TM; m += 4) {
        const float4 x = *reinterpret_cast<const float4*>(&P_s[c * ldP + ty * TM + m]);
        p[m] = x.x, p[m + 1] = x.y, p[m + 2] = x.z, p[m + 3] = x.w;
      }
      load_cols<d>(v, &V_s[c * d], tx);
      for (int m = 0; m < TM; m++)
        for (int e = 0; e < TX; e++) O_i[m][e] += p[m] * v[e];
    }
  }
  for (int m = 0; m < TM; m++) {
    const int r = row0 + ty * TM + m;
    for (int off = 8; off > 0; off /= 2) l_i[m] += __shfl_xor_sync(~0u, l_i[m], off);
    if (r >= N) continue;
    for (int e = 0; e < TX; e++) O[(size_t)r * d + col<d>(tx, e)] = O_i[m][e] / l_i[m];   // l.13, l.15
    if (tx == 0) L[r] = (m_i[m] + log2f(l_i[m])) * LN2;                    // l.14, l.16: L_i = m_i + log(l_i)
  }
}

// ------------------------------------------------------------------------------------------------------
// D_i = rowsum(dO_i o O_i) (Algorithm 2, l.5), computed before the backward kernel. One warp per row.
__device__ float to_float(float x) { return x; }
__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__global__ void flash_bwd_preprocess(const T* __restrict__ O, const T* __restrict__ dO,
                                     float* __restrict__ D, size_t rows, int d) {
  const size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  float acc = 0.f;
  for (int x = lane; x < d; x += 32) acc += to_float(O[row * d + x]) * to_float(dO[row * d + x]);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(~0u, acc, off);
  if (lane == 0) D[row] = acc;
}

// ------------------------------------------------------------------------------------------------------
// fp32 backward: FlashAttention-2, Algorithm 2.
// Grid (T_c, B*H): one block per key block K_j, V_j of one head; it loops over the query blocks Q_i.
// Block: 128 threads as 8 (ty) x 16 (tx). Thread (ty, tx) owns
//   S_ij, dP_ij (B_r, B_c): rows ty*TM + m, columns tx + 16*n        (as in the forward)
//   dK_j, dV_j  (B_c, d):   rows ty*TC + c, columns col(tx, e)       (kept in registers across all i)
//   dQ_i        (B_r, d):   rows ty*TM + m, columns col(tx, e)
// dQ is accumulated with fp32 atomicAdd, as in FlashAttention-2: dQ_i receives one term from every key
// block, and those blocks run concurrently. The alternative, a second kernel with query blocks outer,
// is deterministic but recomputes S_ij and dP_ij (7 block products instead of 5). The price of atomics:
// the order of the additions, and so the last bits of dQ, can change from run to run.
template <int d, int B_r, int B_c>
__global__ void __launch_bounds__(128)
flash_bwd_fp32(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
               const float* __restrict__ dO, const float* __restrict__ L, const float* __restrict__ D,
               float* __restrict__ dQ, float* __restrict__ dK, float* __restrict__ dV,
               int N, float scale, bool causal) {
  constexpr int TM = B_r / 8, TN = B_c / 16, TC = B_c / 8, TX = d / 16, ld = d + 4, ldS = B_c + 4;
  extern __shared__ float smem[];
  float* K_s = smem;              // K_j    (B_c, d)   row stride ld
  float* V_s = K_s + B_c * ld;    // V_j    (B_c, d)   row stride ld
  float* Q_s = V_s + B_c * ld;    // Q_i    (B_r, d)   row stride ld
  float* dO_s = Q_s + B_r * ld;   // dO_i   (B_r, d)   row stride ld
  float* P_s = dO_s + B_r * ld;   // P_ij   (B_r, B_c) row stride ldS
  float* dS_s = P_s + B_r * ldS;  // dS_ij  (B_r, B_c) row stride ldS
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int j = blockIdx.x, col0 = j * B_c;
  const size_t head = (size_t)blockIdx.y * N * d;
  Q += head; K += head; V += head; dO += head; dQ += head; dK += head; dV += head;
  L += (size_t)blockIdx.y * N; D += (size_t)blockIdx.y * N;
  const float scale_log2 = scale * LOG2E;

  load_tile<B_c, d, 128>(K_s, ld, K, col0, N);                             // l.7: load K_j, V_j
  load_tile<B_c, d, 128>(V_s, ld, V, col0, N);
  float dK_j[TC][TX] = {}, dV_j[TC][TX] = {};                              // l.8: dK_j = dV_j = 0

  const int T_r = (N + B_r - 1) / B_r;
  for (int i = causal ? col0 / B_r : 0; i < T_r; i++) {                    // l.9 (causal: skip blocks above)
    const int row0 = i * B_r;
    __syncthreads();  // every thread is done reading Q_s, dO_s, P_s, dS_s of block i-1
    load_tile<B_r, d, 128>(Q_s, ld, Q, row0, N);                           // l.10: load Q_i, dO_i, L_i, D_i
    load_tile<B_r, d, 128>(dO_s, ld, dO, row0, N);
    float L_i[TM], D_i[TM];
    for (int m = 0; m < TM; m++) {
      const int r = row0 + ty * TM + m;
      L_i[m] = r < N ? L[r] * LOG2E : 0.f;
      D_i[m] = r < N ? D[r] : 0.f;
    }
    __syncthreads();  // Q_i, dO_i (and K_j, V_j on the first pass) are in shared memory

    float S_ij[TM][TN] = {}, dP_ij[TM][TN] = {};
    mma_XYt<TM, TN, d>(S_ij, Q_s, K_s, ld, tx, ty);                        // l.11: S_ij = Q_i K_j^T
    mma_XYt<TM, TN, d>(dP_ij, dO_s, V_s, ld, tx, ty);                      // l.14: dP_ij = dO_i V_j^T
    for (int m = 0; m < TM; m++)
      for (int n = 0; n < TN; n++) {
        const int r = row0 + ty * TM + m, c = col0 + tx + 16 * n;
        const bool seen = r < N && c < N && !(causal && c > r);
        const float P = seen ? exp2f(S_ij[m][n] * scale_log2 - L_i[m]) : 0.f;  // l.12: P_ij = exp(S_ij - L_i)
        P_s[(ty * TM + m) * ldS + tx + 16 * n] = P;
        dS_s[(ty * TM + m) * ldS + tx + 16 * n] = P * (dP_ij[m][n] - D_i[m]);  // l.15: dS_ij = P o (dP - D_i)
      }
    __syncthreads();  // P_ij and dS_ij are complete: the products below read columns of other threads

    for (int r = 0; r < B_r; r++) {             // l.13: dV_j += P_ij^T dO_i;  l.17: dK_j += dS_ij^T Q_i
      float p[TC], ds[TC], dO_r[TX], Q_r[TX];
      for (int c = 0; c < TC; c += 4) {
        const float4 x = *reinterpret_cast<const float4*>(&P_s[r * ldS + ty * TC + c]);
        const float4 y = *reinterpret_cast<const float4*>(&dS_s[r * ldS + ty * TC + c]);
        p[c] = x.x, p[c + 1] = x.y, p[c + 2] = x.z, p[c + 3] = x.w;
        ds[c] = y.x, ds[c + 1] = y.y, ds[c + 2] = y.z, ds[c + 3] = y.w;
      }
      load_cols<d>(dO_r, &dO_s[r * ld], tx);
      load_cols<d>(Q_r, &Q_s[r * ld], tx);
      for (int c = 0; c < TC; c++)
        for (int e = 0; e < TX; e++) dV_j[c][e] += p[c] * dO_r[e], dK_j[c][e] += ds[c] * Q_r[e];
    }

    float dQ_i[TM][TX] = {};                                               // l.16: dQ_i += dS_ij K_j
    for (int c = 0; c < B_c; c += 4) {
      float4 ds[TM];
      for (int m = 0; m < TM; m++) ds[m] = *reinterpret_cast<const float4*>(&dS_s[(ty * TM + m) * ldS + c]);
      float k0[TX], k1[TX], k2[TX], k3[TX];
      load_cols<d>(k0, &K_s[c * ld], tx), load_cols<d>(k1, &K_s[(c + 1) * ld], tx);
      load_cols<d>(k2, &K_s[(c + 2) * ld], tx), load_cols<d>(k3, &K_s[(c + 3) * ld], tx);
      for (int m = 0; m < TM; m++)
        for (int e = 0; e < TX; e++)
          dQ_i[m][e] += ds[m].x * k0[e] + ds[m].y * k1[e] + ds[m].z * k2[e] + ds[m].w * k3[e];
    }
    for (int m = 0; m < TM; m++) {
      const int r = row0 + ty * TM + m;
      if (r < N)
        for (int e = 0; e < TX; e++) atomicAdd(&dQ[(size_t)r * d + col<d>(tx, e)], scale * dQ_i[m][e]);
    }
  }
  for (int c = 0; c < TC; c++) {                                           // l.19: write dK_j, dV_j
    const int k = col0 + ty * TC + c;
    if (k >= N) continue;
    for (int e = 0; e < TX; e++) {
      dK[(size_t)k * d + col<d>(tx, e)] = scale * dK_j[c][e];
      dV[(size_t)k * d + col<d>(tx, e)] = dV_j[c][e];
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// Tensor cores, one generation at a time: Volta (mma.m8n8k4), Turing (mma.m16n8k8 + ldmatrix), Ampere
// (mma.m16n8k16 + ldmatrix + cp.async). Each section gives the instruction's fragment layout (PTX ISA,
// "Matrix Fragments for mma.m8n8k4 / m16n8k8 / m16n8k16"), its helpers and its kernel. The file is built
// for several targets at once; an instruction a target lacks is compiled out there (SM75, SM80) and
// replaced by a trap, and main.py never launches a kernel on a GPU older than the kernel's min_arch.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
#define SM75 0
#else
#define SM75 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define SM80 0
#else
#define SM80 1
#endif

// ------------------------------------------------------------------------------------------------------
// Volta (sm_70): mma.sync.aligned.m8n8k4, fp16 inputs, fp32 sums. A warp is four quad pairs, and each
// computes its own D (8 x 8) += A (8 x 4) B (4 x 8) with its own operands:
//
//   quad pair q       0        1        2        3        lane = 4q + p       (low group,  hi = 0)
//   low group       0-3      4-7     8-11    12-15        lane = 4q + p + 16  (high group, hi = 1)
//   high group    16-19    20-23    24-27    28-31        p = lane % 4: position in the group
//
// Inside its quad pair, a lane holds
//   A, .row:  a0..a3 = A[p + 4hi][0..3]        a row of A             (8 bytes of a row-major A)
//   B, .col:  b0..b3 = B[0..3][p + 4hi]        a column of B          (8 bytes of a row-major B^T)
//   B, .row:  b0..b3 = B[p][4hi .. 4hi+3]      half a row of B        (8 bytes of a row-major B)
//   C, D:     c_e = D[(lane&1) + (e&2) + 4hi][(e&4) + (lane&2) + (e&1)],  e < 8
// so lane 0 holds D[0][0,1,4,5] and D[2][0,1,4,5]. sm_70 has no ldmatrix: operands are plain 8-byte
// loads. And the accumulator layout is not the A layout: a result cannot feed the next product straight
// from registers, as it does from Turing on.

// for (m, n) in 8 x 8, in every quad pair: c[m][n] += sum_k a[m][k] * b[k][n], k < 4 (B given by columns)
__device__ void mma_m8n8k4_row_col(float (&c)[8], uint2 a, uint2 b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
               "{%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
               : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y));
}
// the same product with B given by rows
__device__ void mma_m8n8k4_row_row(float (&c)[8], uint2 a, uint2 b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
               "{%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
               : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y));
}

// fp16 forward on Volta tensor cores (sm_70+): FlashAttention-2, Algorithm 1.
// Grid (T_r, B*H); NW warps, B_r = 16*NW, B_c = 64; warp w owns rows 16w .. 16w+15 of Q_i, S_ij and O_i.
// In every mma the four quad pairs tile a 16 x 16 piece of the result: quad pair q = rh + 2ch takes its
// rows 8rh .. 8rh+7 and columns 8ch .. 8ch+7. Per warp and block j (c: a 16-wide piece):
//   S_ij (16, B_c)  = Q_i (16, d) K_j^T (d, B_c)    d/4 x B_c/16 mma, S[c][8]
//   O_i  (16, d)   += P_ij (16, B_c) V_j (B_c, d)   B_c/4 x d/16 mma, O_i[c][8]
// A lane holds rows r and r+2 of S_ij and O_i (h = (e&2)/2 picks one). P_ij goes through shared memory,
// one (16, B_c) tile per warp, to get from the accumulator layout to the A layout. Loads are synchronous.
template <int d, int NW>
__global__ void __launch_bounds__(NW * 32)
flash_fwd_volta(const __half* __restrict__ Q, const __half* __restrict__ K, const __half* __restrict__ V,
                __half* __restrict__ O, float* __restrict__ L, int N, float scale_log2, bool causal) {
  constexpr int B_r = 16 * NW, B_c = 64, ld = d + 8, ldP = B_c + 4;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* K_s = reinterpret_cast<__half*>(smem_raw);  // K_j  (B_c, d)  row stride ld
  __half* V_s = K_s + B_c * ld;                       // V_j  (B_c, d)  row stride ld
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // this warp's P_ij (16, B_c), row stride ldP = B_c + 4: rows 34 words apart put the 8 rows that a half-warp's
  // A loads read (8rh + 4hi + p) in 8 different bank pairs (a stride of B_c would put them in one)
  __half* P_s = V_s + B_c * ld + warp * 16 * ldP;
  const int p = lane % 4, rh = lane / 4 % 2, ch = lane / 8 % 2, hi = lane / 16;
  const int i = gridDim.x - 1 - blockIdx.x, row0 = i * B_r + 16 * warp;  // row0: this warp's first row
  const size_t head = (size_t)blockIdx.y * N * d;
  Q += head; K += head; V += head; O += head; L += (size_t)blockIdx.y * N;
  const int T_c = (N + B_c - 1) / B_c;
  const int j_end = causal ? min(T_c, (i * B_r + B_r - 1) / B_c + 1) : T_c;

  uint2 Q_frag[d / 4];  // l.5: A fragments of Q_i for k = 4kk .. 4kk+3: this lane's row, read from global
  const int q_row = row0 + 8 * rh + 4 * hi + p;
  for (int kk = 0; kk < d / 4; kk++)
    Q_frag[kk] = q_row < N ? *reinterpret_cast<const uint2*>(&Q[(size_t)q_row * d + 4 * kk]) : make_uint2(0, 0);

  const int r = row0 + 8 * rh + 4 * hi + lane % 2;  // this lane's rows of S_ij and O_i: r and r + 2
  float O_i[d / 16][8] = {}, m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};  // l.6
  for (int j = 0; j < j_end; j++) {                                         // l.7
    load_tile<B_c, d, NW * 32>(K_s, ld, K, j * B_c, N);                      // l.8
    load_tile<B_c, d, NW * 32>(V_s, ld, V, j * B_c, N);
    __syncthreads();  // K_j and V_j are complete for every warp

    float S[B_c / 16][8] = {};                                              // l.9: S_ij = Q_i K_j^T
    for (int kk = 0; kk < d / 4; kk++)
      for (int c = 0; c < B_c / 16; c++) {  // B = K_j^T: this lane's column is key 16c + 8ch + 4hi + p
        const uint2 b = *reinterpret_cast<const uint2*>(&K_s[(16 * c + 8 * ch + 4 * hi + p) * ld + 4 * kk]);
        mma_m8n8k4_row_col(S[c], Q_frag[kk], b);
      }

    const bool masked = causal ? (j + 1) * B_c > i * B_r : (j + 1) * B_c > N;  // any masked entry in block?
    float rowmax[2] = {m_i[0], m_i[1]};                                     // l.10: online softmax
    for (int c = 0; c < B_c / 16; c++)
      for (int e = 0; e < 8; e++) {
        const int key = j * B_c + 16 * c + 8 * ch + (e & 4) + (lane & 2) + (e & 1), h = e / 2 % 2;
        S[c][e] = (masked && (key >= N || (causal && key > r + 2 * h))) ? -INFINITY : S[c][e] * scale_log2;
        rowmax[h] = fmaxf(rowmax[h], S[c][e]);
      }
    float alpha[2];
    for (int h = 0; h < 2; h++) {  // a row is spread over lanes lane ^ 2 (columns) and lane ^ 8 (quad pairs)
      rowmax[h] = fmaxf(rowmax[h], __shfl_xor_sync(~0u, rowmax[h], 2));
      rowmax[h] = fmaxf(rowmax[h], __shfl_xor_sync(~0u, rowmax[h], 8));
      alpha[h] = exp2f(m_i[h] - rowmax[h]);  // e^(m^(j-1) - m^(j)); m^(j) is finite as key 0 comes first
      m_i[h] = rowmax[h];
      l_i[h] *= alpha[h];
    }
    for (int c = 0; c < d / 16; c++)                                        // l.11 (first half): rescale O_i
      for (int e = 0; e < 8; e++) O_i[c][e] *= alpha[e / 2 % 2];
    for (int c = 0; c < B_c / 16; c++)                                      // P_ij = exp(S_ij - m_i)
      for (int e = 0; e < 8; e += 2) {
        const int h = e / 2 % 2;
        const float p0 = exp2f(S[c][e] - m_i[h]), p1 = exp2f(S[c][e + 1] - m_i[h]);
        l_i[h] += p0 + p1;  // this lane's share of rowsum(P_ij)
        *reinterpret_cast<__half2*>(&P_s[(r - row0 + 2 * h) * ldP + 16 * c + 8 * ch + (e & 4) + (lane & 2)]) =
            __floats2half2_rn(p0, p1);
      }
    __syncwarp();  // this warp's P_ij is in shared memory before its lanes read each other's values
    for (int kk = 0; kk < B_c / 4; kk++) {                                  // l.11: O_i += P_ij V_j
      // A: this lane's row of P_ij, keys 4kk .. 4kk+3.  B (.row): key 4kk + p, columns 16c + 8ch + 4hi ..
      const uint2 a = *reinterpret_cast<const uint2*>(&P_s[(8 * rh + 4 * hi + p) * ldP + 4 * kk]);
      for (int c = 0; c < d / 16; c++) {
        const uint2 b = *reinterpret_cast<const uint2*>(&V_s[(4 * kk + p) * ld + 16 * c + 8 * ch + 4 * hi]);
        mma_m8n8k4_row_row(O_i[c], a, b);
      }
    }
    __syncthreads();  // every warp is done with K_j, V_j and its P_ij before block j+1 overwrites them
  }
  for (int h = 0; h < 2; h++) {
    l_i[h] += __shfl_xor_sync(~0u, l_i[h], 2);
    l_i[h] += __shfl_xor_sync(~0u, l_i[h], 8);
    if (r + 2 * h >= N) continue;
    for (int c = 0; c < d / 16; c++)                                        // l.13, l.15: O_i / l_i
      for (int e = 2 * h; e < 8; e += 4)
        *reinterpret_cast<__half2*>(&O[(size_t)(r + 2 * h) * d + 16 * c + 8 * ch + (e & 4) + (lane & 2)]) =
            __floats2half2_rn(O_i[c][e] / l_i[h], O_i[c][e + 1] / l_i[h]);
    if ((lane & 2) == 0 && ch == 0) L[r + 2 * h] = (m_i[h] + log2f(l_i[h])) * LN2;  // l.14, l.16: one of 4 lanes
  }
}

// ------------------------------------------------------------------------------------------------------
// Turing (sm_75): mma.sync.aligned.m16n8k8, fp16 inputs, fp32 sums, computed by the whole warp. With
// lane = 4g + t (g = lane / 4 in 0..7, t = lane % 4 in 0..3), the fragments of
//   D (16 x 8, fp32) += A (16 x 8, row-major) * B (8 x 8, column-major)
// are (each register of A and B holds two 16-bit values, the lower column or row in the low half):
//   A: a0 = A[g][2t, 2t+1]   a1 = A[g+8][2t, 2t+1]          B: b0 = B[2t, 2t+1][g]
//   D: d0, d1 = D[g][2t, 2t+1]                              d2, d3 = D[g+8][2t, 2t+1]
// The kernels below work on 16-wide k slices: a 16 x 16 A tile is four registers, a[0], a[1] for columns
// 0..7 and a[2], a[3] for columns 8..15 (a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]); a 16 x 8
// B tile is two, b0 for rows 0..7 and b1 for rows 8..15. D's layout for two neighbouring 16 x 8 tiles is
// A's layout for one 16 x 16 tile: that is why P_ij can go from the S_ij accumulators straight into the
// next product without touching shared memory.

// for (m, n) in 16 x 8: d[m][n] += sum_k a[m][k] * b[k][n], k < 8
__device__ void mma_m16n8k8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
#if SM75
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(b0));
#else
  __trap();
#endif
}
// the same for k < 16: one m16n8k8 per 8-wide half of the slice
__device__ void mma_m16n8k8_x2(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_m16n8k8(d, a[0], a[1], b0);
  mma_m16n8k8(d, a[2], a[3], b1);
}

// ldmatrix.x4 (sm_75+): four 8 x 8 matrices of 16-bit values from shared memory, one per group of 8 lanes.
// Lane l gives the address of one row: row l % 8 of matrix l / 8. Afterwards register r[i] of lane l holds
//   matrix i, row l / 4, columns 2*(l % 4) and 2*(l % 4) + 1            (no .trans: a row of 2 values)
//   matrix i, rows 2*(l % 4) and 2*(l % 4) + 1, column l / 4           (.trans: a column of 2 values)
// which is exactly one register of an A or B fragment above.
__device__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if SM75
  const uint32_t addr = __cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#else
  __trap();
#endif
}
__device__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if SM75
  const uint32_t addr = __cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#else
  __trap();
#endif
}

// Two floats rounded to one register of two 16-bit values (lo in the low half), as fragments hold them.
template <typename T> __device__ uint32_t pack(float lo, float hi);
template <> __device__ uint32_t pack<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ uint32_t pack<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Slice kk of accumulators S with n columns (n/8 tiles of 16 x 8, fp32) as the A fragment of an m16n8k16
// over those columns (16-bit): tiles 2kk and 2kk+1, each lane keeping its own values, since the D and A
// layouts put the same rows and columns in the same lanes.
template <typename T, int n>
__device__ void A_fragment(uint32_t (&a)[4], const float (&S)[n / 8][4], int kk) {
  a[0] = pack<T>(S[2 * kk][0], S[2 * kk][1]), a[1] = pack<T>(S[2 * kk][2], S[2 * kk][3]);
  a[2] = pack<T>(S[2 * kk + 1][0], S[2 * kk + 1][1]), a[3] = pack<T>(S[2 * kk + 1][2], S[2 * kk + 1][3]);
}

// 2^x as one MUFU.EX2 instruction (ex2.approx.ftz: relative error about 2^-22, results below 2^-126 flushed to
// zero). exp2f gives the same values but adds a compare and two multiplies per call to keep such tiny
// results as denormals, which a probability in fp16 or bf16 cannot hold anyway.
__device__ inline float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Steps of the forward shared by the Turing, Ampere and Hopper kernels. In the m16n8 accumulator layout a
// lane holds rows g and g+8 (h = e / 2) and columns 2t, 2t+1 (e % 2) of every 16 x 8 tile of the warp's
// 16 rows; r is this lane's row g as a row of Q.

// l.10: masks S_ij (16, B_c) (causal, or keys past N; c0 = key of tile 0, column 2t), scales it to base-2
// units, updates m_i, and multiplies l_i by alpha = e^(m_i^(j-1) - m_i^(j)) (exp2 of the difference of the
// base-2 m_i). O_i gets the same factor from rescale (l.11), a separate step because the Hopper kernel
// must first wait for the product still accumulating into O_i.
template <int B_c>
__device__ void online_softmax(float (&S)[B_c / 8][4], float (&m_i)[2], float (&l_i)[2], float (&alpha)[2], int r,
                               int c0, int N, bool masked, bool causal, float scale_log2) {
  float rowmax[2] = {m_i[0], m_i[1]};
  for (int nt = 0; nt < B_c / 8; nt++)
    for (int e = 0; e < 4; e++) {
      const int row = r + 8 * (e / 2), key = c0 + 8 * nt + e % 2;
      S[nt][e] = (masked && (key >= N || (causal && key > row))) ? -INFINITY : S[nt][e] * scale_log2;
      rowmax[e / 2] = fmaxf(rowmax[e / 2], S[nt][e]);
    }
  for (int h = 0; h < 2; h++) {  // the 4 lanes of a quad (same g) hold one row: reduce across them
    rowmax[h] = fmaxf(rowmax[h], __shfl_xor_sync(~0u, rowmax[h], 1));
    rowmax[h] = fmaxf(rowmax[h], __shfl_xor_sync(~0u, rowmax[h], 2));
    alpha[h] = exp2_ftz(m_i[h] - rowmax[h]);  // m^(j) is finite: every row sees key 0 in block 0
    m_i[h] = rowmax[h];
    l_i[h] *= alpha[h];
  }
}

template <int d>
__device__ void rescale(float (&O_i)[d / 8][4], const float (&alpha)[2]) {
  for (int nt = 0; nt < d / 8; nt++)
    for (int e = 0; e < 4; e++) O_i[nt][e] *= alpha[e / 2];
}

// P_ij = exp(S_ij - m_i) for one 16 x 8 accumulator tile s, packed as the two A-fragment registers that
// hold its rows g and g+8 in P_ij V_j; this lane's share of rowsum(P_ij) is added to l_i (l.11).
template <typename T>
__device__ void exp_and_pack(uint32_t& row_g, uint32_t& row_g8, const float (&s)[4], const float (&m_i)[2],
                             float (&l_i)[2]) {
  float p[4];
  for (int e = 0; e < 4; e++) p[e] = exp2_ftz(s[e] - m_i[e / 2]);
  l_i[0] += p[0] + p[1], l_i[1] += p[2] + p[3];
  row_g = pack<T>(p[0], p[1]), row_g8 = pack<T>(p[2], p[3]);
}

// l.13-16: O_i / l_i into O as T, and L_i = m_i + log(l_i) in natural-log units.
template <typename T, int d>
__device__ void write_O_L(const float (&O_i)[d / 8][4], const float (&m_i)[2], float (&l_i)[2], T* O, float* L,
                          int r, int t, int N) {
  for (int h = 0; h < 2; h++) {
    l_i[h] += __shfl_xor_sync(~0u, l_i[h], 1);  // the row's sum over the 4 lanes of its quad
    l_i[h] += __shfl_xor_sync(~0u, l_i[h], 2);
    if (r + 8 * h >= N) continue;
    for (int nt = 0; nt < d / 8; nt++)
      *reinterpret_cast<uint32_t*>(&O[(size_t)(r + 8 * h) * d + 8 * nt + 2 * t]) =
          pack<T>(O_i[nt][2 * h] / l_i[h], O_i[nt][2 * h + 1] / l_i[h]);
    if (t == 0) L[r + 8 * h] = (m_i[h] + log2f(l_i[h])) * LN2;
  }
}

// Rows r and r + 8 of a (16, d) block of m16n8 accumulators, times f, into the row-major X as T: the rows
// below N (the backward kernels' dK_j and dV_j, l.19).
template <typename T, int d>
__device__ void store_rows(T* X, const float (&acc)[d / 8][4], int r, int t, int N, float f) {
  for (int h = 0; h < 2; h++)
    if (r + 8 * h < N)
      for (int nt = 0; nt < d / 8; nt++)
        *reinterpret_cast<uint32_t*>(&X[(size_t)(r + 8 * h) * d + 8 * nt + 2 * t]) =
            pack<T>(f * acc[nt][2 * h], f * acc[nt][2 * h + 1]);
}

// fp16 forward on Turing tensor cores (sm_75+): FlashAttention-2, Algorithm 1, with what sm_75 has:
// mma.m16n8k8 (two per 16-wide k slice), ldmatrix, and loads that pass through registers and block until
// they land (no cp.async, so no double buffering). An SM has 64 KB of shared memory: Q_i goes to
// registers through the K_j, V_j buffers, and d = 128 uses B_c = 32, so that 3 blocks fit on an SM.
// Grid (T_r, B*H); NW warps, B_r = 16*NW; warp w owns rows 16w .. 16w+15 of Q_i, S_ij and O_i outright
// (no reduction across warps). Per warp and block j (nt: 8-column tile, kk: 16-wide k slice):
//   S_ij (16, B_c)  = Q_i (16, d) K_j^T (d, B_c)    d/16 x B_c/8 x 2 mma, S[nt][4]
//   O_i  (16, d)   += P_ij (16, B_c) V_j (B_c, d)   B_c/16 x d/8 x 2 mma, O_i[nt][4]
template <int d, int NW, int B_c>
__global__ void __launch_bounds__(NW * 32)
flash_fwd_turing(const __half* __restrict__ Q, const __half* __restrict__ K, const __half* __restrict__ V,
                 __half* __restrict__ O, float* __restrict__ L, int N, float scale_log2, bool causal) {
  // Rows padded to d + 8 halves: the extra 16 bytes shift consecutive rows by 4 banks, so the 8 rows an
  // ldmatrix reads fall in 8 different 16-byte bank groups (a stride of d would put all 8 in one).
  constexpr int B_r = 16 * NW, ld = d + 8;
  static_assert(B_r <= 2 * B_c, "Q_i passes through the K_j and V_j buffers");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* K_s = reinterpret_cast<__half*>(smem_raw);  // K_j  (B_c, d)  row stride ld  (at first: Q_i)
  __half* V_s = K_s + B_c * ld;                       // V_j  (B_c, d)  row stride ld
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int i = gridDim.x - 1 - blockIdx.x, row0 = i * B_r;
  const size_t head = (size_t)blockIdx.y * N * d;
  Q += head; K += head; V += head; O += head; L += (size_t)blockIdx.y * N;
  const int T_c = (N + B_c - 1) / B_c;
  const int j_end = causal ? min(T_c, (row0 + B_r - 1) / B_c + 1) : T_c;

  load_tile<B_r, d, NW * 32>(K_s, ld, Q, row0, N);                         // l.5: load Q_i
  __syncthreads();  // Q_i is complete
  uint32_t Q_frag[d / 16][4];  // A fragments of this warp's 16 rows of Q_i, one per 16-wide k slice
  for (int kk = 0; kk < d / 16; kk++)  // lane l points at row l % 16, column 16*kk + 8*(l / 16)
    ldmatrix_x4(Q_frag[kk], &K_s[(16 * warp + lane % 16) * ld + 16 * kk + 8 * (lane / 16)]);

  float O_i[d / 8][4] = {}, m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};  // l.6
  for (int j = 0; j < j_end; j++) {                                         // l.7
    __syncthreads();  // every warp is done with the buffers (Q_i, or K_j-1 and V_j-1) before the refill
    load_tile<B_c, d, NW * 32>(K_s, ld, K, j * B_c, N);                      // l.8
    load_tile<B_c, d, NW * 32>(V_s, ld, V, j * B_c, N);
    __syncthreads();  // K_j and V_j are complete

    float S[B_c / 8][4] = {};                                               // l.9: S_ij = Q_i K_j^T
    for (int kk = 0; kk < d / 16; kk++)
      for (int nt = 0; nt < B_c / 8; nt += 2) {
        // B fragments of keys 8nt .. 8nt+15: lane l points at key 8nt + l%8 + 8*(l/16), column 16kk + 8*((l/8)%2)
        uint32_t b[4];
        ldmatrix_x4(b, &K_s[(8 * nt + lane % 8 + 8 * (lane / 16)) * ld + 16 * kk + 8 * (lane / 8 % 2)]);
        mma_m16n8k8_x2(S[nt], Q_frag[kk], b[0], b[1]);
        mma_m16n8k8_x2(S[nt + 1], Q_frag[kk], b[2], b[3]);
      }
    const bool masked = causal ? (j + 1) * B_c > row0 : (j + 1) * B_c > N;  // any masked entry in block?
    float alpha[2];  // l.10, and the rescaling of O_i in l.11
    online_softmax<B_c>(S, m_i, l_i, alpha, row0 + 16 * warp + g, j * B_c + 2 * t, N, masked, causal, scale_log2);
    rescale<d>(O_i, alpha);
    for (int kk = 0; kk < B_c / 16; kk++) {                                 // l.11: O_i += P_ij V_j
      uint32_t P_frag[4];  // the S accumulators of tiles 2kk, 2kk+1 are the A fragment of slice kk
      exp_and_pack<__half>(P_frag[0], P_frag[1], S[2 * kk], m_i, l_i);      // keys 16kk .. 16kk+7
      exp_and_pack<__half>(P_frag[2], P_frag[3], S[2 * kk + 1], m_i, l_i);  // keys 16kk+8 .. 16kk+15
      for (int nt = 0; nt < d / 8; nt += 2) {
        // B fragments of V_j (keys 16kk .. 16kk+15, columns 8nt .. 8nt+15), transposed on the way:
        // lane l points at key 16kk + l%8 + 8*((l/8)%2), column 8nt + 8*(l/16)
        uint32_t b[4];
        ldmatrix_x4_trans(b, &V_s[(16 * kk + lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * nt + 8 * (lane / 16)]);
        mma_m16n8k8_x2(O_i[nt], P_frag, b[0], b[1]);
        mma_m16n8k8_x2(O_i[nt + 1], P_frag, b[2], b[3]);
      }
    }
  }
  write_O_L<__half, d>(O_i, m_i, l_i, O, L, row0 + 16 * warp + g, t, N);   // l.13-16
}

// ------------------------------------------------------------------------------------------------------
// Ampere (sm_80): mma.sync.aligned.m16n8k16 multiplies a whole 16-wide k slice in one instruction, on the
// same four A registers and two B registers that Turing feeds to two m16n8k8, and takes bf16 as well as
// fp16. The fragments of D (16 x 8, fp32) += A (16 x 16, row-major) * B (16 x 8, column-major):
//   A: a0 = A[g][2t, 2t+1]   a1 = A[g+8][2t, 2t+1]   a2 = A[g][2t+8, 2t+9]   a3 = A[g+8][2t+8, 2t+9]
//   B: b0 = B[2t, 2t+1][g]   b1 = B[2t+8, 2t+9][g]
//   D: d0, d1 = D[g][2t, 2t+1]                       d2, d3 = D[g+8][2t, 2t+1]
// cp.async copies global to shared memory without passing through registers, so the next K_j, V_j can
// be in flight while this one is multiplied.

// for (m, n) in 16 x 8: d[m][n] += sum_k a[m][k] * b[k][n], k < 16, fp16 or bf16 inputs, fp32 sums
template <typename T> __device__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if SM80
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}
template <> __device__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if SM80
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// cp.async: copy 16 bytes global -> shared without passing through registers; the thread goes on at once.
// With src_bytes = 0 nothing is read and the 16 bytes are zero-filled (rows past N). Copies issued since
// the last commit form a group; wait_group<n> blocks until at most n groups are still in flight.
__device__ void cp_async_16(void* dst, const void* src, bool in_bounds) {
#if SM80
  const uint32_t addr = __cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(src), "r"(in_bounds ? 16 : 0));
#else
  __trap();
#endif
}
__device__ void cp_async_4(float* dst, const float* src, bool in_bounds) {  // the same for one float
#if SM80
  const uint32_t addr = __cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(addr), "l"(src), "r"(in_bounds ? 4 : 0));
#else
  __trap();
#endif
}
__device__ void cp_async_commit() {
#if SM80
  asm volatile("cp.async.commit_group;");
#endif
}
template <int n>
__device__ void cp_async_wait() {
#if SM80
  asm volatile("cp.async.wait_group %0;" ::"n"(n));
#endif
}

// dst[0] += x, dst[1] += y: one 8-byte atomic on sm_90 and newer (half the requests), two before.
__device__ void atomic_add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x), atomicAdd(dst + 1, y);
#endif
}

// Starts copying a (rows, d) tile of 16-bit values into shared memory with row stride d + 8 (padded
// against ldmatrix bank conflicts, as in the Turing kernel), zero-filling rows at or past N.
template <int rows, int d, int n_threads, typename T>
__device__ void cp_async_tile(T* dst, const T* src, int row0, int N) {
  constexpr int pieces = d / 8, step = n_threads / pieces;  // 16-byte pieces per row; rows per pass
  static_assert(n_threads % pieces == 0 && rows % step == 0, "every thread copies the same pieces of each pass");
  const int c = 8 * (threadIdx.x % pieces);
#pragma unroll  // a fixed trip count: no loop, no branch left in the SASS
  for (int k = 0; k < rows / step; k++) {
    const int r = threadIdx.x / pieces + k * step;
    const bool in_bounds = row0 + r < N;
    cp_async_16(&dst[r * (d + 8) + c], &src[(size_t)(in_bounds ? row0 + r : 0) * d + c], in_bounds);
  }
}

// fp16/bf16 forward on Ampere tensor cores (sm_80+): FlashAttention-2, Algorithm 1.
// The Turing kernel's fragments, with one m16n8k16 where Turing issues two m16n8k8, and two changes for
// speed. cp.async: K_j and V_j stream through two shared-memory stages, block j+1 arriving while block j is
// multiplied. And each warp owns 32 rows of Q_i, two 16-row tiles (m = 0, 1), so that every K_j or V_j
// fragment read from shared memory feeds two mma instead of one. An SM's shared memory delivers 128 bytes
// per clock, one ldmatrix.x4 (512 bytes) per 4 clocks: with one mma per fragment it, not the tensor cores,
// set the pace (16 rows per warp measured 208 / 239 TFLOP/s at d = 64 / 128 on an H100, 32 rows 272 / 309).
// Q_i's fragments (64 registers at d = 128) no longer fit beside O_i: each is read from shared memory once
// per k slice and used by B_c/8 mma. Grid (T_r, B*H); NW warps, B_r = 32*NW; warp w owns rows 32w ..
// 32w+31. Per warp, tile m and block j (nt: 8-column tile, kk: 16-wide k slice):
//   S_ij (16, B_c)  = Q_i (16, d) K_j^T (d, B_c)    d/16 x B_c/8 mma, S[m][nt][4]
//   O_i  (16, d)   += P_ij (16, B_c) V_j (B_c, d)   B_c/16 x d/8 mma, O_i[m][nt][4]
template <typename T, int d, int NW, int B_c>
__global__ void __launch_bounds__(NW * 32)
flash_fwd_ampere(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, T* __restrict__ O,
                 float* __restrict__ L, int N, float scale_log2, bool causal) {
  constexpr int B_r = 32 * NW, ld = d + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Q_s = reinterpret_cast<T*>(smem_raw);  // Q_i           (B_r, d)    row stride ld
  T* K_s = Q_s + B_r * ld;                  // K_j, 2 stages (2, B_c, d) row stride ld
  T* V_s = K_s + 2 * B_c * ld;              // V_j, 2 stages (2, B_c, d) row stride ld
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int i = gridDim.x - 1 - blockIdx.x, row0 = i * B_r;
  const size_t head = (size_t)blockIdx.y * N * d;
  Q += head; K += head; V += head; O += head; L += (size_t)blockIdx.y * N;
  const int T_c = (N + B_c - 1) / B_c;
  const int j_end = causal ? min(T_c, (row0 + B_r - 1) / B_c + 1) : T_c;
  const T* Q_w = Q_s + 32 * warp * ld;  // this warp's 32 rows of Q_i
  const int r = row0 + 32 * warp + g;   // this lane's rows: r + 16m and r + 16m + 8 in tile m

  cp_async_tile<B_r, d, NW * 32>(Q_s, Q, row0, N);                        // l.5: load Q_i
  cp_async_tile<B_c, d, NW * 32>(K_s, K, 0, N);                           // l.8 for j = 0
  cp_async_tile<B_c, d, NW * 32>(V_s, V, 0, N);
  cp_async_commit();

  float O_i[2][d / 8][4] = {}, m_i[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}}, l_i[2][2] = {};  // l.6
  for (int j = 0; j < j_end; j++) {                                         // l.7
    const T* K_j = K_s + (j % 2) * B_c * ld;
    const T* V_j = V_s + (j % 2) * B_c * ld;
    if (j + 1 < j_end) {  // l.8 for block j+1, into the other stage (freed by the barrier ending j-1)
      cp_async_tile<B_c, d, NW * 32>(K_s + ((j + 1) % 2) * B_c * ld, K, (j + 1) * B_c, N);
      cp_async_tile<B_c, d, NW * 32>(V_s + ((j + 1) % 2) * B_c * ld, V, (j + 1) * B_c, N);
    }
    cp_async_commit();   // (an empty group on the last block keeps the counting below uniform)
    cp_async_wait<1>();  // everything but the newest group has landed: K_j and V_j (and Q_i)
    __syncthreads();     // ... for every thread's copies

    float S[2][B_c / 8][4] = {};                                            // l.9: S_ij = Q_i K_j^T
#pragma unroll  // (every loop over fragments must unroll, or the arrays they index go to local memory)
    for (int kk = 0; kk < d / 16; kk++) {
      uint32_t Q_frag[2][4];  // A fragments of tiles m = 0, 1 (addresses as in the Turing kernel)
      for (int m = 0; m < 2; m++) ldmatrix_x4(Q_frag[m], &Q_w[(16 * m + lane % 16) * ld + 16 * kk + 8 * (lane / 16)]);
      for (int nt = 0; nt < B_c / 8; nt += 2) {
        uint32_t b[4];  // B fragments of keys 8nt .. 8nt+15 (addresses as in the Turing kernel), used twice
        ldmatrix_x4(b, &K_j[(8 * nt + lane % 8 + 8 * (lane / 16)) * ld + 16 * kk + 8 * (lane / 8 % 2)]);
        for (int m = 0; m < 2; m++)
          mma_m16n8k16<T>(S[m][nt], Q_frag[m], b[0], b[1]), mma_m16n8k16<T>(S[m][nt + 1], Q_frag[m], b[2], b[3]);
      }
    }
    const bool masked = causal ? (j + 1) * B_c > row0 : (j + 1) * B_c > N;  // any masked entry in block?
#pragma unroll
    for (int m = 0; m < 2; m++) {  // l.10, and the rescaling of O_i in l.11
      float alpha[2];
      online_softmax<B_c>(S[m], m_i[m], l_i[m], alpha, r + 16 * m, j * B_c + 2 * t, N, masked, causal, scale_log2);
      rescale<d>(O_i[m], alpha);
    }
#pragma unroll
    for (int kk = 0; kk < B_c / 16; kk++) {                                 // l.11: O_i += P_ij V_j
      uint32_t P_frag[2][4];  // the S accumulators of tiles 2kk, 2kk+1 are the A fragment of slice kk
      for (int m = 0; m < 2; m++) {
        exp_and_pack<T>(P_frag[m][0], P_frag[m][1], S[m][2 * kk], m_i[m], l_i[m]);      // keys 16kk .. +7
        exp_and_pack<T>(P_frag[m][2], P_frag[m][3], S[m][2 * kk + 1], m_i[m], l_i[m]);  // keys 16kk+8 .. +15
      }
      for (int nt = 0; nt < d / 8; nt += 2) {
        uint32_t b[4];  // B fragments of V_j, transposed on the way (addresses as in the Turing kernel)
        ldmatrix_x4_trans(b, &V_j[(16 * kk + lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * nt + 8 * (lane / 16)]);
        for (int m = 0; m < 2; m++)
          mma_m16n8k16<T>(O_i[m][nt], P_frag[m], b[0], b[1]), mma_m16n8k16<T>(O_i[m][nt + 1], P_frag[m], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with stage j % 2 before iteration j+1 refills it
  }
#pragma unroll
  for (int m = 0; m < 2; m++) write_O_L<T, d>(O_i[m], m_i[m], l_i[m], O, L, r + 16 * m, t, N);  // l.13-16
}

// ------------------------------------------------------------------------------------------------------
// fp16/bf16 backward on Ampere tensor cores (sm_80+): FlashAttention-2, Algorithm 2.
// Grid (T_c, B*H): one block per key block K_j, V_j of one head, looping over query blocks Q_i.
// Block of NW warps, B_c = 16*NW keys; warp w owns keys 16w .. 16w+15 and so rows of the transposed
// products below, which keep dK_j and dV_j in its registers for the whole loop (fragment layout: see
// the Turing section above; nt: 8-column tile, kk: 16-wide k slice):
//   S_ij^T  (16, B_r) = K_j Q_i^T        dP_ij^T (16, B_r) = V_j dO_i^T
//   dV_j    (16, d)  += P_ij^T dO_i       dK_j    (16, d)  += dS_ij^T Q_i
// Working with transposes lets P_ij^T and dS_ij^T go from accumulators straight into the next product.
// dQ_i = dS_ij K_j sums over all the block's keys, i.e. over warps: dS_ij^T goes through shared memory,
// each warp computes one (16, d/CW) piece of dQ_i and adds it into an fp32 dQ with atomics (see the fp32
// backward for why atomics); main.py converts dQ to the input dtype at the end. L_i and D_i travel with
// Q_i and dO_i: read from global memory where they are used, they cost each thread 64 loads per block that
// its warp then waited for (Nsight Compute); moving them, with 8-byte atomics and unrolled loops, took the
// backward from 179 to 252 TFLOP/s (H100, fp16, d = 128, N = 4096).
template <typename T, int d, int B_r, int NW>
__global__ void __launch_bounds__(NW * 32)
flash_bwd_ampere(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
                 const T* __restrict__ dO, const float* __restrict__ L, const float* __restrict__ D,
                 float* __restrict__ dQ, T* __restrict__ dK, T* __restrict__ dV, int N, float scale, bool causal) {
  constexpr int B_c = 16 * NW, ld = d + 8, ldS = B_r + 8;
  constexpr int MT = B_r / 16, CW = NW / MT;  // dQ_i: MT row tiles x CW column groups, one per warp
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* K_s = reinterpret_cast<T*>(smem_raw);  // K_j               (B_c, d)      row stride ld
  T* V_s = K_s + B_c * ld;                  // V_j               (B_c, d)      row stride ld
  T* Q_s = V_s + B_c * ld;                  // Q_i, 2 stages     (2, B_r, d)   row stride ld
  T* dO_s = Q_s + 2 * B_r * ld;             // dO_i, 2 stages    (2, B_r, d)   row stride ld
  T* dS_s = dO_s + 2 * B_r * ld;            // dS_ij^T           (B_c, B_r)    row stride ldS
  float* L_s = reinterpret_cast<float*>(dS_s + B_c * ldS);  // L_i, 2 stages  (2, B_r)
  float* D_s = L_s + 2 * B_r;                               // D_i, 2 stages  (2, B_r)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int j = blockIdx.x, col0 = j * B_c;
  const size_t head = (size_t)blockIdx.y * N * d;
  Q += head; K += head; V += head; dO += head; dQ += head; dK += head; dV += head;
  L += (size_t)blockIdx.y * N; D += (size_t)blockIdx.y * N;
  const float scale_log2 = scale * LOG2E;
  const int T_r = (N + B_r - 1) / B_r, i_start = causal ? col0 / B_r : 0;  // causal: skip blocks above
  const T* K_w = K_s + 16 * warp * ld;  // this warp's 16 keys
  const T* V_w = V_s + 16 * warp * ld;
  auto load_i = [&](int i, int stage) {  // l.10: Q_i, dO_i, L_i, D_i into one of the two stages
    cp_async_tile<B_r, d, NW * 32>(Q_s + stage * B_r * ld, Q, i * B_r, N);
    cp_async_tile<B_r, d, NW * 32>(dO_s + stage * B_r * ld, dO, i * B_r, N);
    const int r = i * B_r + threadIdx.x;
    if (threadIdx.x < B_r) {
      cp_async_4(&L_s[stage * B_r + threadIdx.x], &L[r < N ? r : 0], r < N);
      cp_async_4(&D_s[stage * B_r + threadIdx.x], &D[r < N ? r : 0], r < N);
    }
  };

  cp_async_tile<B_c, d, NW * 32>(K_s, K, col0, N);                         // l.7: load K_j, V_j
  cp_async_tile<B_c, d, NW * 32>(V_s, V, col0, N);
  load_i(i_start, 0);
  cp_async_commit();
  float dK_j[d / 8][4] = {}, dV_j[d / 8][4] = {};                          // l.8: dK_j = dV_j = 0

  for (int i = i_start; i < T_r; i++) {                                     // l.9
    const int row0 = i * B_r, stage = (i - i_start) % 2;
    const T* Q_i = Q_s + stage * B_r * ld;
    const T* dO_i = dO_s + stage * B_r * ld;
    const float *L_i = L_s + stage * B_r, *D_i = D_s + stage * B_r;
    if (i + 1 < T_r) load_i(i + 1, 1 - stage);  // into the other stage (freed by the barrier ending i-1)
    cp_async_commit();
    cp_async_wait<1>();  // all but the newest group have landed: Q_i, dO_i, L_i, D_i (and K_j, V_j)
    __syncthreads();     // ... for every thread's copies

    float S[B_r / 8][4] = {}, dP[B_r / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < d / 16; kk++) {
      uint32_t K_frag[4], V_frag[4];  // A fragments: this warp's 16 keys, dims 16kk .. 16kk+15
      ldmatrix_x4(K_frag, &K_w[(lane % 16) * ld + 16 * kk + 8 * (lane / 16)]);
      ldmatrix_x4(V_frag, &V_w[(lane % 16) * ld + 16 * kk + 8 * (lane / 16)]);
#pragma unroll
      for (int nt = 0; nt < B_r / 8; nt += 2) {  // B fragments: queries 8nt .. 8nt+15 (as K_j in the forward)
        uint32_t q[4], o[4];
        ldmatrix_x4(q, &Q_i[(8 * nt + lane % 8 + 8 * (lane / 16)) * ld + 16 * kk + 8 * (lane / 8 % 2)]);
        ldmatrix_x4(o, &dO_i[(8 * nt + lane % 8 + 8 * (lane / 16)) * ld + 16 * kk + 8 * (lane / 8 % 2)]);
        mma_m16n8k16<T>(S[nt], K_frag, q[0], q[1]), mma_m16n8k16<T>(S[nt + 1], K_frag, q[2], q[3]);     // l.11: S_ij^T
        mma_m16n8k16<T>(dP[nt], V_frag, o[0], o[1]), mma_m16n8k16<T>(dP[nt + 1], V_frag, o[2], o[3]);  // l.14: dP_ij^T
      }
    }
    const bool edge = (causal && row0 < col0 + B_c) || row0 + B_r > N || col0 + B_c > N;
#pragma unroll
    for (int nt = 0; nt < B_r / 8; nt++) {
      const float2 L_r = *reinterpret_cast<const float2*>(&L_i[8 * nt + 2 * t]);  // queries 8nt + 2t, + 1
      const float2 D_r = *reinterpret_cast<const float2*>(&D_i[8 * nt + 2 * t]);
#pragma unroll
      for (int e = 0; e < 4; e++) {  // entry (key c, query r) of P^T and dS^T
        const int c = col0 + 16 * warp + g + 8 * (e / 2), r = row0 + 8 * nt + 2 * t + e % 2;
        const bool seen = !edge || (r < N && c < N && !(causal && c > r));
        const float L_r_e = e % 2 ? L_r.y : L_r.x, D_r_e = e % 2 ? D_r.y : D_r.x;
        S[nt][e] = seen ? exp2_ftz(S[nt][e] * scale_log2 - L_r_e * LOG2E) : 0.f;  // l.12: P_ij = exp(S_ij - L_i)
        dP[nt][e] = S[nt][e] * (dP[nt][e] - D_r_e);                             // l.15: dS_ij = P o (dP - D_i)
      }
    }
#pragma unroll
    for (int kk = 0; kk < B_r / 16; kk++) {  // l.13: dV_j += P_ij^T dO_i;  l.17: dK_j += dS_ij^T Q_i
      uint32_t P_frag[4], dS_frag[4];  // queries 16kk .. 16kk+15 of P_ij^T and dS_ij^T as A fragments
      A_fragment<T, B_r>(P_frag, S, kk), A_fragment<T, B_r>(dS_frag, dP, kk);
#pragma unroll
      for (int h = 0; h < 2; h++) {  // dS_ij^T into shared memory for dQ_i: rows g and g+8 of this warp
        const int c = 16 * warp + g + 8 * h;
        *reinterpret_cast<uint32_t*>(&dS_s[c * ldS + 16 * kk + 2 * t]) = dS_frag[h];
        *reinterpret_cast<uint32_t*>(&dS_s[c * ldS + 16 * kk + 8 + 2 * t]) = dS_frag[2 + h];
      }
#pragma unroll
      for (int nt = 0; nt < d / 8; nt += 2) {  // B fragments: queries 16kk.., dims 8nt.. (as V_j in the forward)
        uint32_t o[4], q[4];
        ldmatrix_x4_trans(o, &dO_i[(16 * kk + lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * nt + 8 * (lane / 16)]);
        ldmatrix_x4_trans(q, &Q_i[(16 * kk + lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * nt + 8 * (lane / 16)]);
        mma_m16n8k16<T>(dV_j[nt], P_frag, o[0], o[1]), mma_m16n8k16<T>(dV_j[nt + 1], P_frag, o[2], o[3]);
        mma_m16n8k16<T>(dK_j[nt], dS_frag, q[0], q[1]), mma_m16n8k16<T>(dK_j[nt + 1], dS_frag, q[2], q[3]);
      }
    }
    __syncthreads();  // all of dS_ij^T is in shared memory: dQ_i needs every warp's keys

    // l.16: dQ_i += dS_ij K_j. Warp w: queries 16*(w % MT) .. +15, dims (w / MT) * d/CW .. + d/CW.
    const int m0 = 16 * (warp % MT), n0 = (warp / MT) * (d / CW);
    float dQ_i[d / CW / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < B_c / 16; kk++) {
      // A fragment of dS_ij (queries m0.., keys 16kk..) read transposed from dS_ij^T: lane l points at
      // key 16kk + l%8 + 8*(l/16), query m0 + 8*((l/8)%2)
      uint32_t a[4];
      ldmatrix_x4_trans(a, &dS_s[(16 * kk + lane % 8 + 8 * (lane / 16)) * ldS + m0 + 8 * (lane / 8 % 2)]);
#pragma unroll
      for (int nt = 0; nt < d / CW / 8; nt += 2) {  // B fragments of K_j: keys 16kk.., dims n0 + 8nt..
        uint32_t b[4];
        ldmatrix_x4_trans(b, &K_s[(16 * kk + lane % 8 + 8 * (lane / 8 % 2)) * ld + n0 + 8 * nt + 8 * (lane / 16)]);
        mma_m16n8k16<T>(dQ_i[nt], a, b[0], b[1]), mma_m16n8k16<T>(dQ_i[nt + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int r = row0 + m0 + g + 8 * h;
      if (r < N)
#pragma unroll
        for (int nt = 0; nt < d / CW / 8; nt++)
          atomic_add_pair(&dQ[(size_t)r * d + n0 + 8 * nt + 2 * t], scale * dQ_i[nt][2 * h], scale * dQ_i[nt][2 * h + 1]);
    }
    __syncthreads();  // every warp is done with Q_s, dO_s stage and dS_s before the next block refills them
  }
  store_rows<T, d>(dK, dK_j, col0 + 16 * warp + g, t, N, scale);          // l.19: write dK_j, dV_j
  store_rows<T, d>(dV, dV_j, col0 + 16 * warp + g, t, N, 1.f);
}

// ------------------------------------------------------------------------------------------------------
// Hopper (sm_90a): TMA, wgmma and warp specialisation. What changes from Ampere:
// - TMA (the tensor memory accelerator) copies a whole tile from global to shared memory by itself: one
//   thread issues cp.async.bulk.tensor with a tensor map (built on the host: the tensor's shape and
//   strides, the box to copy, the swizzle), and the copy counts its bytes down on an mbarrier in shared
//   memory; threads that need the tile wait on that barrier. Rows past N arrive as zeros.
// - wgmma: a warpgroup (4 consecutive warps, 128 threads) computes a 64 x n x 16 product in one
//   asynchronous instruction, reading B, and A if it is not in registers, from shared memory through a
//   64-bit descriptor. Warp w of the group holds rows 16w .. 16w+15 of the fp32 result in the m16n8
//   accumulator layout of the Ampere section, and an A operand in registers uses the m16n8k16 A layout,
//   so online_softmax, rescale, pack and write_O_L apply unchanged and P_ij goes from the accumulators of
//   S_ij straight into O_i += P_ij V_j, as on Ampere.
// - Warp specialisation: one warpgroup only loads (the producer) and hands most of its registers to the
//   warpgroups that only compute (the consumers) with setmaxnreg.
// Shared memory holds each tile as d/64 panels of (rows, 64): 128 bytes per row, and within each 1024-byte
// group of 8 rows the 16-byte piece c of row r sits at piece c ^ (r % 8) (TMA's and wgmma's 128-byte
// swizzle), so the 8 rows of a 16-byte column fall in 8 different bank groups. A descriptor gives a
// panel's start address, SBO = 1024 (bytes from one group of 8 rows to the next) and, for an operand that
// spans two panels along n, LBO (bytes from one panel to the next).
#ifndef __CUDACC_RTC__  // NVRTC (the sm_70 check) compiles the sections above only
#include <cuda.h>       // CUtensorMap
#include <cstdlib>      // getenv
#include <type_traits>
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SM90A 0  // wgmma and setmaxnreg exist on sm_90a only: other targets get an empty kernel
#else
#define SM90A 1
#endif

__device__ inline uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// An mbarrier counts arrivals and transaction bytes; its phase completes when the expected arrivals have
// come and the expected bytes have landed, and then the next phase begins. Waiters name the phase by parity.
__device__ inline void mbar_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals));
}
__device__ inline void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ inline void mbar_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {  // arrive; `bytes` more to land
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ inline void mbar_wait(uint32_t bar, int parity) {  // until the phase of this parity has completed
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

// for (r, c) in the map's box (rows, 64): dst[swizzled (r, c)] = X[head][row + r][col + c], zero past N;
// the copy runs on its own and counts its bytes on bar.
__device__ inline void tma_load(uint32_t dst, const CUtensorMap& map, int col, int row, int head, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(col), "r"(row), "r"(head), "r"(bar) : "memory");
}

// The descriptor of a 128-byte-swizzled operand at shared address addr (1024-aligned panel + k offset).
__device__ inline uint64_t smem_desc(uint32_t addr, uint32_t lbo) {
  return (addr & 0x3FFFF) >> 4 | uint64_t(lbo >> 4) << 16 | uint64_t(1024 >> 4) << 32 | 1ull << 62;
}

// wgmma.fence: registers written by ordinary instructions (P_ij, the rescaled O_i) are ready for wgmma.
// commit_group closes a group of the wgmma issued so far; wait_group n blocks until at most n groups
// are still running (groups finish in order).
// The empty asm statements after the wait keep the compiler from reading acc before that point.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int tiles>
__device__ inline void keep_after_wait(float (&acc)[tiles][4]) {
  for (int nt = 0; nt < tiles; nt++)
    for (int e = 0; e < 4; e++) asm volatile("" : "+f"(acc[nt][e])::"memory");
}
template <int pending, int... tiles>
__device__ inline void wgmma_wait(float (&... acc)[tiles][4]) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(pending) : "memory");
  (keep_after_wait(acc), ...);
}

#define ACC4(i) "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3])
#define ACC_N32 ACC4(0), ACC4(1), ACC4(2), ACC4(3)
#define ACC_N64 ACC_N32, ACC4(4), ACC4(5), ACC4(6), ACC4(7)
#define ACC_N128 ACC_N64, ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15)
#define REGS_N32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
                  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
                  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
                  "%56, %57, %58, %59, %60, %61, %62, %63}"

// C (64, n) = A (64, 16) B (16, n), or C += A B when accumulate: for (m, c): C[m][c] (+)= sum_k A[m][k] * B[k][c],
// k < 16, fp32 sums, n = 32, 64 or 128. A and B in shared memory, K-major (contiguous along k: Q_i and K_j as
// stored, for S_ij = Q_i K_j^T) unless transposed: trans_a = 1, A is M-major (contiguous along m: dS_ij^T as
// stored, for dS_ij); trans_b = 1, B is N-major (contiguous along n: K_j as stored, for dS_ij K_j).
// Lane (warp w, g, t) holds C[16w + g (+8)][8nt + 2t (+1)].
template <typename T, int n, int trans_a = 0, int trans_b = 0>
__device__ inline void wgmma_ss(float (&acc)[n / 8][4], uint64_t a, uint64_t b, bool accumulate) {
#define WGMMA_SS(N, TY, REGS, ACCUMULATE, OPS, ACC)                                                       \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, " ACCUMULATE ", 0; wgmma.mma_async.sync.aligned.m64n" N     \
               "k16.f32." TY "." TY " " REGS ", " OPS "; }"                                                \
               : ACC : "l"(a), "l"(b), "r"(int(accumulate)), "n"(trans_a), "n"(trans_b))
  constexpr bool half = std::is_same_v<T, __half>;
  if constexpr (n == 32 && half) WGMMA_SS("32", "f16", REGS_N32, "%18", "%16, %17, p, 1, 1, %19, %20", ACC_N32);
  if constexpr (n == 32 && !half) WGMMA_SS("32", "bf16", REGS_N32, "%18", "%16, %17, p, 1, 1, %19, %20", ACC_N32);
  if constexpr (n == 64 && half) WGMMA_SS("64", "f16", REGS_N64, "%34", "%32, %33, p, 1, 1, %35, %36", ACC_N64);
  if constexpr (n == 64 && !half) WGMMA_SS("64", "bf16", REGS_N64, "%34", "%32, %33, p, 1, 1, %35, %36", ACC_N64);
  if constexpr (n == 128 && half) WGMMA_SS("128", "f16", REGS_N128, "%66", "%64, %65, p, 1, 1, %67, %68", ACC_N128);
  if constexpr (n == 128 && !half) WGMMA_SS("128", "bf16", REGS_N128, "%66", "%64, %65, p, 1, 1, %67, %68", ACC_N128);
}

// O (64, n) += A (64, 16) B (16, n), n = 64 or 128, with A in registers (a: the m16n8k16 A fragment of this
// warp's 16 rows) and B in shared memory N-major (rows of B contiguous along n: V_j as stored; the last
// immediate, imm-trans-b = 1, says so).
template <typename T, int n>
__device__ inline void wgmma_m64nNk16_rs(float (&acc)[n / 8][4], const uint32_t (&a)[4], uint64_t b) {
#define WGMMA_RS(N, TY, REGS, OPS, ACC) asm volatile("wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " \
                                                     REGS ", " OPS ", 1, 1, 1, 1;"                                   \
                                                     : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
  constexpr bool half = std::is_same_v<T, __half>;
  if constexpr (n == 64 && half) WGMMA_RS("64", "f16", REGS_N64, "{%32, %33, %34, %35}, %36", ACC_N64);
  if constexpr (n == 64 && !half) WGMMA_RS("64", "bf16", REGS_N64, "{%32, %33, %34, %35}, %36", ACC_N64);
  if constexpr (n == 128 && half) WGMMA_RS("128", "f16", REGS_N128, "{%64, %65, %66, %67}, %68", ACC_N128);
  if constexpr (n == 128 && !half) WGMMA_RS("128", "bf16", REGS_N128, "{%64, %65, %66, %67}, %68", ACC_N128);
}

// All n/16 slices of S as A fragments (the A operand of a wgmma from registers has the same layout).
template <typename T, int n>
__device__ void to_A_fragments(uint32_t (&A)[n / 16][4], const float (&S)[n / 8][4]) {
  for (int kk = 0; kk < n / 16; kk++) A_fragment<T, n>(A[kk], S, kk);
}

// fp16/bf16 forward on Hopper (sm_90a): FlashAttention-2's Algorithm 1 with FlashAttention-3's machinery.
// Grid (T_r, B*H); 1 + NWG warpgroups; B_r = 64*NWG, B_c = 128. Warpgroup 0 is the producer: one of its
// threads issues every TMA load. Warpgroup c = 1..NWG is a consumer owning rows 64(c-1) .. 64c-1 of Q_i,
// S_ij and O_i; per block j it computes, with the m16n8 fragments of the Ampere kernel in each warp:
//   S_ij (64, B_c)  = Q_i (64, d) K_j^T (d, B_c)    d/16 wgmma m64n128k16, A and B from shared memory
//   O_i  (64, d)   += P_ij (64, B_c) V_j (B_c, d)   B_c/16 wgmma m64n{d}k16, A (P_ij) from registers
// Three kinds of waiting keep the tensor cores busy:
// - K_j, V_j stream through STAGES shared-memory stages: full[s] completes when stage s has landed,
//   empty[s] when every consumer warp has finished reading it (mbarriers). The producer refills a stage
//   as soon as it is empty, up to STAGES blocks ahead.
// - A consumer issues S_i,j+1 = Q_i K_j+1^T and O_i += P_ij V_j together and computes the softmax of
//   block j+1 while P_ij V_j runs (wgmma.wait_group 1, then 0).
// - The consumers take turns to issue their products (named barriers), so that one's softmax runs on
//   the CUDA cores while the other's products run on the tensor cores. Over time, NWG = 2:
//   tensor cores  | c1: S_i,j+1 then P_ij V_j   | c2: S_i,j+1 then P_ij V_j   | c1: S_i,j+2 ...
//   consumer 1    | issue; wait for S; softmax  | wait for PV; arrive empty;  | issue; wait for S ...
//                 |                             | O_i *= alpha; pack P        |
//   consumer 2    | wait for PV; arrive empty;  | issue; wait for S; softmax  | wait for PV ...
//                 | O_i *= alpha; pack P        |                             |
template <typename T, int d, int NWG, int B_c, int STAGES>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
flash_fwd_hopper(const __grid_constant__ CUtensorMap Q_map, const __grid_constant__ CUtensorMap K_map,
                 const __grid_constant__ CUtensorMap V_map, T* __restrict__ O, float* __restrict__ L, int N,
                 float scale_log2, bool causal) {
#if SM90A
  constexpr int B_r = 64 * NWG;
  static_assert(B_c == 128, "S_ij is one wgmma m64n128k16 per k slice");
  constexpr uint32_t Q_bytes = B_r * d * sizeof(T), KV_bytes = B_c * d * sizeof(T);  // one tile
  // Registers per thread after setmaxnreg: the producer needs few; the consumers share the rest of the
  // SM's 64 K (multiples of 8, at most 240 per thread for NWG = 2)
  constexpr int producer_regs = 24, consumer_regs = (65536 / 128 - producer_regs) / NWG / 8 * 8;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t Q_s = (smem_addr(smem_raw) + 1023) & ~1023u;    // Q_i (B_r, d); swizzling needs 1024-alignment
  auto K_s = [&](int s) { return Q_s + Q_bytes + 2 * s * KV_bytes; };  // K_j in stage s (B_c, d)
  auto V_s = [&](int s) { return K_s(s) + KV_bytes; };                  // V_j in stage s (B_c, d)
  const uint32_t Q_full = Q_s + Q_bytes + 2 * STAGES * KV_bytes;        // then the mbarriers, 8 bytes each
  auto full = [&](int s) { return Q_full + 8 * (1 + s); };
  auto empty = [&](int s) { return Q_full + 8 * (1 + STAGES + s); };
  const int wg = threadIdx.x / 128, i = gridDim.x - 1 - blockIdx.x, row0 = i * B_r, head = blockIdx.y;
  const int T_c = (N + B_c - 1) / B_c;
  const int j_end = causal ? min(T_c, (row0 + B_r - 1) / B_c + 1) : T_c;  // causal: blocks past the diagonal skipped

  if (threadIdx.x == 0) {
    mbar_init(Q_full, 1);
    for (int s = 0; s < STAGES; s++) mbar_init(full(s), 1), mbar_init(empty(s), 4 * NWG);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // initialised before TMA signals them
  }
  __syncthreads();  // no thread waits on a barrier before it is initialised

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(producer_regs));
    if (threadIdx.x == 0) {
      mbar_arrive_expect_bytes(Q_full, Q_bytes);                                   // l.5: load Q_i
      for (int c = 0; c < d / 64; c++) tma_load(Q_s + c * B_r * 128, Q_map, 64 * c, row0, head, Q_full);
      for (int j = 0; j < j_end; j++) {                                            // l.8: load K_j, V_j
        const int s = j % STAGES;
        if (j >= STAGES) mbar_wait(empty(s), (j / STAGES - 1) % 2);  // block j - STAGES is out of stage s
        mbar_arrive_expect_bytes(full(s), 2 * KV_bytes);
        for (int c = 0; c < d / 64; c++) {
          tma_load(K_s(s) + c * B_c * 128, K_map, 64 * c, j * B_c, head, full(s));
          tma_load(V_s(s) + c * B_c * 128, V_map, 64 * c, j * B_c, head, full(s));
        }
      }
    }
  } else {  // consumer warpgroup wg: rows 64(wg-1) .. 64wg-1 of the block
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(consumer_regs));
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r = row0 + 64 * (wg - 1) + 16 * warp + g;  // this lane's rows are r and r + 8
    const uint32_t Q_wg = Q_s + 64 * (wg - 1) * 128;     // this warpgroup's 64 rows of each Q_i panel
    float O_i[d / 8][4] = {}, m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};  // l.6
    float S[B_c / 8][4], alpha[2];  // S_ij, then P_ij in fp32
    uint32_t P[B_c / 16][4];        // P_ij as A fragments, read by the wgmma on O_i
    // S_ij = Q_i K_j^T (l.9) on tensor cores, for j's stage s: d/16 wgmma, k slice kk 32 bytes * (kk % 4) into
    // panel kk / 4 of Q_i and K_j. Only issued: wgmma_wait collects the result.
    auto issue_S = [&](int s) {
      for (int kk = 0; kk < d / 16; kk++)
        wgmma_ss<T, B_c>(S, smem_desc(Q_wg + kk / 4 * B_r * 128 + kk % 4 * 32, 0),
                         smem_desc(K_s(s) + kk / 4 * B_c * 128 + kk % 4 * 32, 0), kk > 0);
      wgmma_commit();
    };
    // l.10 for block j, on the CUDA cores: m_i, l_i and alpha updated, S_ij replaced by P_ij in place (fp32)
    auto softmax = [&](int j) {
      const bool masked = causal ? (j + 1) * B_c > row0 : (j + 1) * B_c > N;  // any masked entry in block?
      online_softmax<B_c>(S, m_i, l_i, alpha, r, j * B_c + 2 * t, N, masked, causal, scale_log2);
      for (int nt = 0; nt < B_c / 8; nt++)
        for (int e = 0; e < 4; e++) S[nt][e] = exp2_ftz(S[nt][e] - m_i[e / 2]), l_i[e / 2] += S[nt][e];
    };
    // O_i += P_ij V_j (l.11) for j's stage s: B_c/16 wgmma, keys 16kk..16kk+15 (16 rows of V_j, 2048 bytes)
    // in slice kk. Only issued; afterwards this warp releases stage s once wgmma_wait has collected O_i.
    auto issue_PV = [&](int s) {
      for (int kk = 0; kk < B_c / 16; kk++)
        wgmma_m64nNk16_rs<T, d>(O_i, P[kk], smem_desc(V_s(s) + kk * 2048, B_c * 128));
      wgmma_commit();
    };
    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(s));  // this warp has finished reading stage s
    };

    // The softmax of block j+1 runs on the CUDA cores while the tensor cores compute P_ij V_j:
    //   S_i0 = Q_i K_0^T; softmax
    //   for j: issue S_i,j+1 = Q_i K_j+1^T; issue O_i += P_ij V_j; wait for S_i,j+1; softmax;
    //          wait for O_i; release stage j; O_i *= alpha; P_i,j+1 from S
    //   last block: O_i += P_ij V_j
    // The consumers take turns to issue (named barrier c is consumer c's turn), so that while one waits
    // for its products the other's softmax has the CUDA cores, and the tensor cores always have work.
    auto my_turn = [&] { asm volatile("bar.sync %0, %1;" ::"r"(wg), "n"(256) : "memory"); };
    auto next_turn = [&] { asm volatile("bar.arrive %0, %1;" ::"r"(wg % NWG + 1), "n"(256) : "memory"); };
    if (wg == NWG) next_turn();  // consumer 1 goes first
    mbar_wait(Q_full, 0);
    mbar_wait(full(0), 0);
    my_turn();
    wgmma_fence();
    issue_S(0);
    next_turn();
    wgmma_wait<0>(S);
    softmax(0);  // (O_i = 0: no rescale)
    to_A_fragments<T, B_c>(P, S);  // P_ij as the A operand of O_i += P_ij V_j
    for (int j = 0; j + 1 < j_end; j++) {                                          // l.7
      const int s = j % STAGES, s_next = (j + 1) % STAGES;
      mbar_wait(full(s_next), (j + 1) / STAGES % 2);  // K_j+1 and V_j+1 have landed
      my_turn();
      wgmma_fence();  // S, P and O_i were last written by ordinary instructions
      issue_S(s_next);
      issue_PV(s);
      next_turn();
      wgmma_wait<1>(S);  // S_i,j+1 is done; P_ij V_j may still be running
      softmax(j + 1);
      wgmma_wait<0>(O_i);
      release(s);
      rescale<d>(O_i, alpha);
      to_A_fragments<T, B_c>(P, S);
    }
    my_turn();
    wgmma_fence();
    issue_PV((j_end - 1) % STAGES);
    if (wg < NWG) next_turn();  // (the last consumer's turn token would never be taken)
    wgmma_wait<0>(O_i);
    write_O_L<T, d>(O_i, m_i, l_i, O + (size_t)head * N * d, L + (size_t)head * N, r, t, N);  // l.13-16
  }
#endif
}

// A warp's (16, n) block of fp32 m16n8 accumulators X as T into a panel of 128-byte rows with the 128-byte
// swizzle, this lane's rows being row and row + 8 (row % 8 = g): tile nt, element e goes to row
// row + 8(e / 2), columns 8nt + 2t, +1, in 16-byte piece nt, which the swizzle moves to piece nt ^ g.
template <typename T, int n>
__device__ void store_panel(uint32_t panel, const float (&X)[n / 8][4], int row, int g, int t) {
  for (int nt = 0; nt < n / 8; nt++)
    for (int h = 0; h < 2; h++)
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(panel + (row + 8 * h) * 128 + (nt ^ g) * 16 + 4 * t),
                   "r"(pack<T>(X[nt][2 * h], X[nt][2 * h + 1])) : "memory");
}

// By one warp: L_i log2(e) and D_i of query rows row0 .. row0 + B_r - 1 into LD (2, B_r), 0 past N.
template <int B_r>
__device__ void copy_L_D(float* LD, const float* L, const float* D, int row0, int N) {
  for (int x = threadIdx.x % 32; x < B_r; x += 32) {
    const int r = row0 + x;
    LD[x] = r < N ? L[r] * LOG2E : 0.f;
    LD[B_r + x] = r < N ? D[r] : 0.f;
  }
}

// fp16/bf16 backward on Hopper (sm_90a): FlashAttention-2's Algorithm 2 with the forward's producer
// warpgroup and mbarrier stages, and the Ampere backward's transposed products.
// Grid (T_c, B*H): one block per key block K_j, V_j (B_c = 128 keys) of one head, looping over query blocks
// (B_r = 64). Warpgroup 0 is the producer: one thread loads K_j and V_j once, then Q_i and dO_i into STAGES
// stages with TMA, and warp 1 copies L_i and D_i beside them. Consumer c = 1, 2 owns keys 64(c-1) .. 64c-1
// of the block, and so the rows of its transposed products (warp w: keys 16w .. 16w+15 of the 64):
//   S_ij^T  (64, B_r) = K_j Q_i^T      d/16 wgmma m64n64k16
//   dP_ij^T (64, B_r) = V_j dO_i^T     d/16 wgmma m64n64k16
//   dV_j    (64, d)  += P_ij^T dO_i    B_r/16 wgmma m64n{d}k16
//   dK_j    (64, d)  += dS_ij^T Q_i    B_r/16 wgmma m64n{d}k16
//   dQ_i (B_r, d/2) += dS_ij K_j       B_c/16 wgmma m64n{d/2}k16 (A: dS_ij^T read transposed)
// with every operand in shared memory: P_ij^T and dS_ij^T go there from the accumulators, so that the
// registers hold dK_j and dV_j (64 + 64 per thread at d = 128) and the products in flight. dQ_i sums over
// the keys of both consumers: after a barrier that joins them, consumer c computes columns (c-1) d/2 ..
// c d/2 - 1 over all 128 keys and adds them into an fp32 dQ with atomics. (Each consumer adding all columns
// over its own 64 keys would double the atomic traffic: at d = 64 that made the backward 13-20% slower on an
// H100.) P_ij^T and dS_ij^T have two buffers each: block i's are written while block i-1's may still be
// read. The CUDA cores compute block i's P and dS while the tensor cores compute block i-1's dV_j and dK_j:
//   issue S^T, dP^T of block i_start
//   for i: wait S_ij^T: P_ij^T = exp(S - L_i);  wait dP_ij^T: dS_ij^T = P o (dP - D_i)
//          wait dV, dK of block i-1: release its stage;  store P_ij^T, dS_ij^T;  barrier
//          issue dQ_i; wait: add it into dQ;  issue S^T, dP^T of block i+1, then dV, dK of block i
template <typename T, int d, int STAGES>
__global__ void __launch_bounds__(384, 1)
flash_bwd_hopper(const __grid_constant__ CUtensorMap Q_map, const __grid_constant__ CUtensorMap K_map,
                 const __grid_constant__ CUtensorMap V_map, const __grid_constant__ CUtensorMap dO_map,
                 const float* __restrict__ L, const float* __restrict__ D, float* __restrict__ dQ,
                 T* __restrict__ dK, T* __restrict__ dV, int N, float scale, bool causal) {
#if SM90A
  constexpr int B_r = 64, B_c = 128;
  constexpr uint32_t KV_bytes = B_c * d * sizeof(T), Q_bytes = B_r * d * sizeof(T), P_bytes = B_c * B_r * sizeof(T);
  extern __shared__ unsigned char smem_raw[];
  const uint32_t K_s = (smem_addr(smem_raw) + 1023) & ~1023u, V_s = K_s + KV_bytes;  // K_j, V_j (B_c, d)
  auto Q_s = [&](int s) { return V_s + KV_bytes + 2 * s * Q_bytes; };  // Q_i in stage s (B_r, d)
  auto dO_s = [&](int s) { return Q_s(s) + Q_bytes; };                // dO_i in stage s (B_r, d)
  auto P_s = [&](int i) { return Q_s(STAGES) + i % 2 * 2 * P_bytes; };  // P_ij^T (B_c, B_r), buffer i % 2
  auto dS_s = [&](int i) { return P_s(i) + P_bytes; };                  // dS_ij^T (B_c, B_r), buffer i % 2
  auto LD_s = [&](int s) { return Q_s(STAGES) + 4 * P_bytes + s * 2 * B_r * 4; };  // L_i log2(e), D_i (2, B_r)
  const uint32_t KV_full = LD_s(STAGES);                                // then the mbarriers, 8 bytes each
  auto full = [&](int s) { return KV_full + 8 * (1 + s); };
  auto empty = [&](int s) { return KV_full + 8 * (1 + STAGES + s); };
  const int wg = threadIdx.x / 128, j = blockIdx.x, col0 = j * B_c, head = blockIdx.y;
  const int T_r = (N + B_r - 1) / B_r, i_start = causal ? col0 / B_r : 0;  // causal: blocks above skipped
  auto stage = [&](int i) { return (i - i_start) % STAGES; };  // query block i's stage, and how many times
  auto round = [&](int i) { return (i - i_start) / STAGES; };  // that stage has been filled before it

  if (threadIdx.x == 0) {
    mbar_init(KV_full, 1);
    for (int s = 0; s < STAGES; s++) mbar_init(full(s), 1 + 32), mbar_init(empty(s), 256);  // full: TMA, warp 1
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // initialised before TMA signals them
  }
  __syncthreads();  // no thread waits on a barrier before it is initialised

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x == 0) {
      mbar_arrive_expect_bytes(KV_full, 2 * KV_bytes);                       // l.7: load K_j, V_j
      for (int c = 0; c < d / 64; c++) {
        tma_load(K_s + c * B_c * 128, K_map, 64 * c, col0, head, KV_full);
        tma_load(V_s + c * B_c * 128, V_map, 64 * c, col0, head, KV_full);
      }
      for (int i = i_start; i < T_r; i++) {                                   // l.10: load Q_i, dO_i
        const int s = stage(i);
        if (round(i) > 0) mbar_wait(empty(s), (round(i) - 1) % 2);  // block i - STAGES is out of stage s
        mbar_arrive_expect_bytes(full(s), 2 * Q_bytes);
        for (int c = 0; c < d / 64; c++) {
          tma_load(Q_s(s) + c * B_r * 128, Q_map, 64 * c, i * B_r, head, full(s));
          tma_load(dO_s(s) + c * B_r * 128, dO_map, 64 * c, i * B_r, head, full(s));
        }
      }
    } else if (threadIdx.x / 32 == 1) {  // warp 1: L_i and D_i, which TMA cannot copy (rows of N floats are
      for (int i = i_start; i < T_r; i++) {  // not 16-byte aligned); each lane arrives on full(s) when done
        const int s = stage(i);
        if (round(i) > 0) mbar_wait(empty(s), (round(i) - 1) % 2);
        copy_L_D<B_r>(reinterpret_cast<float*>(__cvta_shared_to_generic(LD_s(s))), L + (size_t)head * N,
                      D + (size_t)head * N, i * B_r, N);
        mbar_arrive(full(s));
      }
    }
  } else {  // consumer warpgroup wg: keys 64(wg-1) .. 64wg-1 of the block
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int key0 = 64 * (wg - 1), c = col0 + key0 + 16 * warp + g;  // this lane's keys are c and c + 8
    const int n0 = (wg - 1) * d / 2;  // dQ_i's piece: columns n0 .. n0 + d/2 - 1, over all B_c keys
    const float scale_log2 = scale * LOG2E;
    float dK_j[d / 8][4] = {}, dV_j[d / 8][4] = {};                            // l.8: dK_j = dV_j = 0
    float S[B_r / 8][4], dP[B_r / 8][4];  // S_ij^T, then P_ij^T; dP_ij^T, then dS_ij^T

    // S_ij^T = K_j Q_i^T (l.11) and dP_ij^T = V_j dO_i^T (l.14) for query block i, as two groups: k slice kk
    // is 32 bytes * (kk % 4) into panel kk / 4 of each operand, as in the forward
    auto issue_S_dP = [&](int i) {
      const int s = stage(i);
      mbar_wait(full(s), round(i) % 2);  // Q_i, dO_i, L_i and D_i have landed
      for (int kk = 0; kk < d / 16; kk++)
        wgmma_ss<T, B_r>(S, smem_desc(K_s + kk / 4 * B_c * 128 + key0 * 128 + kk % 4 * 32, 0),
                         smem_desc(Q_s(s) + kk / 4 * B_r * 128 + kk % 4 * 32, 0), kk > 0);
      wgmma_commit();
      for (int kk = 0; kk < d / 16; kk++)
        wgmma_ss<T, B_r>(dP, smem_desc(V_s + kk / 4 * B_c * 128 + key0 * 128 + kk % 4 * 32, 0),
                         smem_desc(dO_s(s) + kk / 4 * B_r * 128 + kk % 4 * 32, 0), kk > 0);
      wgmma_commit();
    };
    // dV_j += P_ij^T dO_i (l.13) and dK_j += dS_ij^T Q_i (l.17), one group. Slice kk: queries 16kk.., which
    // are 32 bytes * kk into the rows of P^T and dS^T (K-major) and rows 16kk.. of dO_i and Q_i (N-major)
    auto issue_dV_dK = [&](int i) {
      const int s = stage(i);
      for (int kk = 0; kk < B_r / 16; kk++)
        wgmma_ss<T, d, 0, 1>(dV_j, smem_desc(P_s(i) + key0 * 128 + kk * 32, 0),
                             smem_desc(dO_s(s) + kk * 2048, B_r * 128), true);
      for (int kk = 0; kk < B_r / 16; kk++)
        wgmma_ss<T, d, 0, 1>(dK_j, smem_desc(dS_s(i) + key0 * 128 + kk * 32, 0),
                             smem_desc(Q_s(s) + kk * 2048, B_r * 128), true);
      wgmma_commit();
    };
    // dQ_i's piece = dS_ij K_j (l.16), added into dQ. Slice kk: keys 16kk.., rows of dS^T (M-major) and of
    // K_j (N-major; the piece's columns start n0 % 64 * 2 bytes into a 128-byte row of panel n0 / 64)
    auto dQ_piece = [&](int i) {
      float dQ_i[d / 16][4];
      for (int kk = 0; kk < B_c / 16; kk++)
        wgmma_ss<T, d / 2, 1, 1>(dQ_i, smem_desc(dS_s(i) + 16 * kk * 128, 0),
                                 smem_desc(K_s + n0 / 64 * B_c * 128 + n0 % 64 * 2 + 16 * kk * 128, 0), kk > 0);
      wgmma_commit();
      wgmma_wait<0>(dQ_i);
      for (int h = 0; h < 2; h++) {
        const int r = i * B_r + 16 * warp + g + 8 * h;  // dQ_i's rows are queries: this lane's are r, r + 8
        if (r < N)
          for (int nt = 0; nt < d / 16; nt++)
            atomic_add_pair(&dQ[((size_t)head * N + r) * d + n0 + 8 * nt + 2 * t], scale * dQ_i[nt][2 * h],
                            scale * dQ_i[nt][2 * h + 1]);
      }
    };
    auto release = [&](int i) {  // every consumer thread has finished reading block i's stage (L_i and D_i
      mbar_arrive(empty(stage(i)));  // included: each thread arrives after its own reads)
    };
    // l.12 and l.15 for block i on the CUDA cores, in place: S_ij^T becomes P_ij^T = exp(S_ij - L_i), dP_ij^T
    // becomes dS_ij^T = P_ij o (dP_ij - D_i). Three groups are in flight: S^T, dP^T and the previous dV, dK.
    auto P_and_dS = [&](int i) {
      const int row0 = i * B_r;
      const float* L_i = reinterpret_cast<const float*>(__cvta_shared_to_generic(LD_s(stage(i))));
      const float* D_i = L_i + B_r;
      const bool edge = (causal && row0 < col0 + key0 + 64) || row0 + B_r > N || col0 + B_c > N;  // any masked?
      wgmma_wait<2>(S);
      for (int nt = 0; nt < B_r / 8; nt++)  // entry (key c + 8(e / 2), query row0 + 8nt + 2t + e % 2)
        for (int e = 0; e < 4; e++) S[nt][e] = exp2_ftz(S[nt][e] * scale_log2 - L_i[8 * nt + 2 * t + e % 2]);
      if (edge)  // keys past N, queries past N, and causal: keys after the query
        for (int nt = 0; nt < B_r / 8; nt++)
          for (int e = 0; e < 4; e++) {
            const int key = c + 8 * (e / 2), r = row0 + 8 * nt + 2 * t + e % 2;
            if (r >= N || key >= N || (causal && key > r)) S[nt][e] = 0.f;
          }
      wgmma_wait<1>(dP);
      for (int nt = 0; nt < B_r / 8; nt++)
        for (int e = 0; e < 4; e++) dP[nt][e] = S[nt][e] * (dP[nt][e] - D_i[8 * nt + 2 * t + e % 2]);
    };
    // P_ij^T and dS_ij^T into buffer i % 2 (last read by block i-2's products, done on both consumers), then
    // dQ_i's piece once they are there
    auto store_and_dQ = [&](int i) {
      store_panel<T, B_r>(P_s(i), S, key0 + 16 * warp + g, g, t);
      store_panel<T, B_r>(dS_s(i), dP, key0 + 16 * warp + g, g, t);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores are visible to wgmma
      asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers have stored dS_ij^T
      wgmma_fence();
      dQ_piece(i);
    };

    // Nothing is in flight across the loop's back edge, so that the compiler can keep the accumulators in
    // place (a product in flight there made it move them, and serialize every wgmma).
    mbar_wait(KV_full, 0);
    wgmma_fence();
    issue_S_dP(i_start);
    wgmma_commit();  // an empty group in place of dV, dK keeps P_and_dS's counting
    P_and_dS(i_start);
    store_and_dQ(i_start);
    for (int i = i_start; i + 1 < T_r; i++) {                                   // l.9
      wgmma_fence();  // S and dP were last used by ordinary instructions
      issue_S_dP(i + 1);
      issue_dV_dK(i);
      P_and_dS(i + 1);
      wgmma_wait<0>(dV_j, dK_j);
      release(i);
      store_and_dQ(i + 1);
    }
    wgmma_fence();
    issue_dV_dK(T_r - 1);
    wgmma_wait<0>(dV_j, dK_j);
    release(T_r - 1);
    store_rows<T, d>(dK + (size_t)head * N * d, dK_j, c, t, N, scale);          // l.19: write dK_j, dV_j
    store_rows<T, d>(dV + (size_t)head * N * d, dV_j, c, t, N, 1.f);
  }
#endif
}
#endif  // __CUDACC_RTC__

#ifndef __CUDACC_RTC__
// ------------------------------------------------------------------------------------------------------
// Host side: one launcher per kernel, one dispatcher for all of them.
#define CUDA_CHECK(call)                                                                     \
  do {                                                                                       \
    cudaError_t err_ = (call);                                                               \
    TORCH_CHECK(err_ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err_), " at " #call); \
  } while (0)

// A tensor's data as T* (T = float, __half or __nv_bfloat16; main.py has checked the dtype).
template <typename T>
T* ptr(const torch::Tensor& x) { return reinterpret_cast<T*>(x.data_ptr()); }

// Kernels that need more than 48 KB of shared memory must ask for it before their first launch.
template <typename Kernel>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, auto... args) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, threads, smem, stream>>>(args...);
  CUDA_CHECK(cudaGetLastError());
}

// The most shared memory one block may have on this GPU: 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86
// and sm_89, 96 KB on sm_70, 64 KB on sm_75. The environment variable FLASH_SMEM_LIMIT (bytes) lowers it,
// so that one GPU can run, and the tests check, the smaller tiles that the launchers choose for others.
size_t max_smem_per_block() {
  int device, bytes;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const char* limit = std::getenv("FLASH_SMEM_LIMIT");
  return limit ? std::min<size_t>(bytes, std::strtoull(limit, nullptr, 10)) : bytes;
}

// Block sizes: with B_r = B_c = 64, four forward blocks (two backward) share an SM of an H100 (three and
// one on an A100); for d > 64 the key block (and the backward's query block) is halved so that three (two)
// still fit on an H100. On a GPU whose
// blocks get less shared memory than that (see above), B_r is halved until the tiles fit.
template <int d, int B_r = 64>
void fwd_fp32(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, torch::Tensor& O,
              torch::Tensor& L, bool causal, float scale, cudaStream_t stream) {
  constexpr int B_c = d <= 64 ? 64 : 32;
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  const size_t smem = sizeof(float) * (B_r * (d + 4) + B_c * std::max(d + 4, B_r + 4) + B_c * d);
  if constexpr (B_r > 32)  // (each thread needs a multiple of 4 rows: B_r >= 32)
    if (smem > max_smem_per_block()) return fwd_fp32<d, B_r / 2>(Q, K, V, O, L, causal, scale, stream);
  launch(flash_fwd_fp32<d, B_r, B_c>, dim3((N + B_r - 1) / B_r, BH), 128, smem, stream,
         Q.data_ptr<float>(), K.data_ptr<float>(), V.data_ptr<float>(), O.data_ptr<float>(),
         L.data_ptr<float>(), N, scale * LOG2E, causal);
}

template <int d, int B_r = (d <= 64 ? 64 : 32)>
void bwd_fp32(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, const torch::Tensor& dO,
              const torch::Tensor& L, const torch::Tensor& D, torch::Tensor& dQ, torch::Tensor& dK,
              torch::Tensor& dV, bool causal, float scale, cudaStream_t stream) {
  constexpr int B_c = d <= 64 ? 64 : 32;
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  const size_t smem = sizeof(float) * (2 * (B_r + B_c) * (d + 4) + 2 * B_r * (B_c + 4));
  if constexpr (B_r > 16)
    if (smem > max_smem_per_block())
      return bwd_fp32<d, B_r / 2>(Q, K, V, dO, L, D, dQ, dK, dV, causal, scale, stream);
  launch(flash_bwd_fp32<d, B_r, B_c>, dim3((N + B_c - 1) / B_c, BH), 128, smem, stream,
         Q.data_ptr<float>(), K.data_ptr<float>(), V.data_ptr<float>(), dO.data_ptr<float>(),
         L.data_ptr<float>(), D.data_ptr<float>(), dQ.data_ptr<float>(), dK.data_ptr<float>(),
         dV.data_ptr<float>(), N, scale, causal);
}

template <int d>
void fwd_volta(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, torch::Tensor& O,
               torch::Tensor& L, bool causal, float scale, cudaStream_t stream) {
  constexpr int NW = 4, B_r = 16 * NW, B_c = 64;  // 26.5 KB (d = 64) or 42.5 KB (d = 128) of shared memory
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  const size_t smem = sizeof(__half) * (2 * B_c * (d + 8) + NW * 16 * (B_c + 4));
  launch(flash_fwd_volta<d, NW>, dim3((N + B_r - 1) / B_r, BH), NW * 32, smem, stream, ptr<__half>(Q),
         ptr<__half>(K), ptr<__half>(V), ptr<__half>(O), ptr<float>(L), N, scale * LOG2E, causal);
}

template <int d>
void fwd_turing(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, torch::Tensor& O,
                torch::Tensor& L, bool causal, float scale, cudaStream_t stream) {
  constexpr int NW = 4, B_r = 16 * NW, B_c = d == 128 ? 32 : 64;  // 18 KB or 17 KB: 3 blocks per 64 KB SM
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  const size_t smem = sizeof(__half) * 2 * B_c * (d + 8);
  launch(flash_fwd_turing<d, NW, B_c>, dim3((N + B_r - 1) / B_r, BH), NW * 32, smem, stream, ptr<__half>(Q),
         ptr<__half>(K), ptr<__half>(V), ptr<__half>(O), ptr<float>(L), N, scale * LOG2E, causal);
}

template <typename T, int d, int B_c = d == 64 ? 128 : 64>
void fwd_ampere(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, torch::Tensor& O,
                torch::Tensor& L, bool causal, float scale, cudaStream_t stream) {
  // Four warps of 32 rows, B_r = 128, and B_c = 128 (d = 64) or 64 (d = 128), as FlashAttention-2 on sm_90:
  // on an H100, 2-6% (d = 64) and 12-15% (d = 128) faster than key blocks half that size. 255 registers
  // (24 bytes spilled) let two blocks share an SM.
  constexpr int NW = 4, B_r = 32 * NW;
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  const size_t smem = sizeof(T) * (B_r + 4 * B_c) * (d + 8);
  if constexpr (d == 128 && B_c == 64)  // 102 KB: more than sm_86 and sm_89 give a block (99 KB), so B_c = 32 there
    if (smem > max_smem_per_block()) return fwd_ampere<T, d, B_c / 2>(Q, K, V, O, L, causal, scale, stream);
  launch(flash_fwd_ampere<T, d, NW, B_c>, dim3((N + B_r - 1) / B_r, BH), NW * 32, smem, stream, ptr<T>(Q), ptr<T>(K),
         ptr<T>(V), ptr<T>(O), ptr<float>(L), N, scale * LOG2E, causal);
}

template <typename T, int d, int NW = 8, int B_r = d == 64 ? 128 : 64>
void bwd_ampere(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, const torch::Tensor& dO,
                const torch::Tensor& L, const torch::Tensor& D, torch::Tensor& dQ, torch::Tensor& dK,
                torch::Tensor& dV, bool causal, float scale, cudaStream_t stream) {
  // Eight warps, B_c = 128 keys: against four warps and B_c = 64, each Q_i, dO_i tile in shared memory serves
  // twice as many warps and dQ gets half as many atomic adds per FLOP (26-37% faster on an H100, fp16, N =
  // 2048-16384, causal or not). B_r = 128 (d = 64) or 64 (d = 128) as FlashAttention-2 on sm_80; at d = 64,
  // 128 measured 9-12% faster than 64 (fp16, N = 2048-16384; 255 registers, no spills).
  constexpr int B_c = 16 * NW;
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  const size_t smem = sizeof(T) * ((2 * B_c + 4 * B_r) * (d + 8) + B_c * (B_r + 8)) + sizeof(float) * 4 * B_r;
  if constexpr (NW == 8 && B_r == (d == 64 ? 128 : 64))  // 144 KB (d = 64) or 155 KB (d = 128)
    if (smem > max_smem_per_block()) {  // sm_86 and sm_89 give a block 99 KB: 91 KB and 73.5 KB tiles there
      if constexpr (d == 64) return bwd_ampere<T, d, 8, 64>(Q, K, V, dO, L, D, dQ, dK, dV, causal, scale, stream);
      else return bwd_ampere<T, d, 4, 32>(Q, K, V, dO, L, D, dQ, dK, dV, causal, scale, stream);
    }
  launch(flash_bwd_ampere<T, d, B_r, NW>, dim3((N + B_c - 1) / B_c, BH), NW * 32, smem, stream, ptr<T>(Q),
         ptr<T>(K), ptr<T>(V), ptr<T>(dO), ptr<float>(L), ptr<float>(D), ptr<float>(dQ), ptr<T>(dK), ptr<T>(dV),
         N, scale, causal);
}

// A TMA tensor map of X (B, H, N, d), seen as (B*H, N, d): boxes of (rows, 64) elements, stored with the
// 128-byte swizzle; rows past N read as zeros. The driver function that encodes it is looked up at run
// time, so the extension needs no link against libcuda.
CUtensorMap tensor_map(const torch::Tensor& X, int rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult found;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                                cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess, "the CUDA driver has no cuTensorMapEncodeTiled");
  }
  const cuuint64_t d = X.size(3), N = X.size(2), bytes = X.element_size();
  const cuuint64_t dims[3] = {d, N, cuuint64_t(X.size(0) * X.size(1))}, strides[2] = {d * bytes, N * d * bytes};
  const cuuint32_t box[3] = {64, cuuint32_t(rows), 1}, steps[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult err = encode(&map, X.scalar_type() == torch::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                     : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                              3, X.data_ptr(), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(err == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult ", int(err));
  return map;
}

template <typename T, int d>
void fwd_hopper(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, torch::Tensor& O,
                torch::Tensor& L, bool causal, float scale, cudaStream_t stream) {
  constexpr int NWG = 2, B_r = 64 * NWG, B_c = 128, STAGES = 3;  // 3 stages: the most that fit at d = 128
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  // Q_i and STAGES stages of K_j, V_j, the mbarriers, and 1 KB of slack to align the tiles to 1024 bytes
  const size_t smem = sizeof(T) * (B_r + 2 * STAGES * B_c) * d + 8 * (1 + 2 * STAGES) + 1024;
  launch(flash_fwd_hopper<T, d, NWG, B_c, STAGES>, dim3((N + B_r - 1) / B_r, BH), 128 * (NWG + 1), smem, stream,
         tensor_map(Q, B_r), tensor_map(K, B_c), tensor_map(V, B_c), ptr<T>(O), ptr<float>(L), N, scale * LOG2E,
         causal);
}

template <typename T, int d>
void bwd_hopper(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V, const torch::Tensor& dO,
                const torch::Tensor& L, const torch::Tensor& D, torch::Tensor& dQ, torch::Tensor& dK,
                torch::Tensor& dV, bool causal, float scale, cudaStream_t stream) {
  // d = 64: a third stage of Q_i, dO_i measured 2-4% faster on an H100; at d = 128 it gained nothing, and
  // would take the shared memory to 226 KB.
  constexpr int B_r = 64, B_c = 128, STAGES = d == 64 ? 3 : 2;
  const int N = Q.size(2), BH = Q.size(0) * Q.size(1);
  // K_j, V_j; STAGES stages of Q_i, dO_i, L_i, D_i; two buffers of P_ij^T and dS_ij^T; the mbarriers; 1 KB of
  // slack to align the tiles to 1024 bytes
  const size_t smem = sizeof(T) * (2 * B_c * d + 2 * STAGES * B_r * d + 4 * B_c * B_r) + STAGES * 2 * B_r * 4 +
                      8 * (1 + 2 * STAGES) + 1024;
  launch(flash_bwd_hopper<T, d, STAGES>, dim3((N + B_c - 1) / B_c, BH), 384, smem, stream, tensor_map(Q, B_r),
         tensor_map(K, B_c), tensor_map(V, B_c), tensor_map(dO, B_r), ptr<float>(L), ptr<float>(D), ptr<float>(dQ),
         ptr<T>(dK), ptr<T>(dV), N, scale, causal);
}

// D = rowsum(dO o O) for every row of every head: 8 rows (one per warp) per block of 256 threads.
template <typename T>
void launch_preprocess(const torch::Tensor& O, const torch::Tensor& dO, torch::Tensor& D, cudaStream_t stream) {
  const int d = O.size(3);
  const size_t rows = O.numel() / d;
  launch(flash_bwd_preprocess<T>, dim3((rows + 7) / 8), 256, 0, stream, ptr<T>(O), ptr<T>(dO), ptr<float>(D),
         rows, d);
}

// Calls f.template operator()<d>() for the run-time head dim d: each d is its own compiled kernel.
template <typename F>
void with_head_dim(int d, F f) {
  switch (d) {
    case 16: return f.template operator()<16>();
    case 32: return f.template operator()<32>();
    case 64: return f.template operator()<64>();
    case 96: return f.template operator()<96>();
    case 128: return f.template operator()<128>();
    default: TORCH_CHECK(false, "head dim must be 16, 32, 64, 96 or 128, got ", d);
  }
}

// The same for the tensor-core kernels: f.template operator()<T, d>() with T the 16-bit type of Q
// (__half or __nv_bfloat16) and d its head dim, 64 or 128.
template <typename F>
void with_type_and_head_dim(const torch::Tensor& Q, F f) {
  const bool half = Q.scalar_type() == torch::kHalf;
  switch (Q.size(3)) {
    case 64: return half ? f.template operator()<__half, 64>() : f.template operator()<__nv_bfloat16, 64>();
    case 128: return half ? f.template operator()<__half, 128>() : f.template operator()<__nv_bfloat16, 128>();
    default: TORCH_CHECK(false, "the tensor-core kernels take head dims 64 and 128, got ", Q.size(3));
  }
}

std::vector<torch::Tensor> forward(const std::string& kernel, const torch::Tensor& Q, const torch::Tensor& K,
                                   const torch::Tensor& V, bool causal, double scale, int64_t stream_ptr) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  auto O = torch::empty_like(Q);                                                   // (B, H, N, d)
  auto L = torch::empty({Q.size(0), Q.size(1), Q.size(2)}, Q.options().dtype(torch::kFloat32));  // (B, H, N)
  if (kernel == "fp32")
    with_head_dim(Q.size(3), [&]<int d>() { fwd_fp32<d>(Q, K, V, O, L, causal, scale, stream); });
  else if (kernel == "volta" || kernel == "turing")  // fp16 only: these GPUs have no bf16 tensor cores
    with_type_and_head_dim(Q, [&]<typename T, int d>() {
      TORCH_CHECK((std::is_same_v<T, __half>), "kernel '", kernel, "' takes float16 only");
      if constexpr (std::is_same_v<T, __half>)
        kernel == "volta" ? fwd_volta<d>(Q, K, V, O, L, causal, scale, stream)
                          : fwd_turing<d>(Q, K, V, O, L, causal, scale, stream);
    });
  else if (kernel == "ampere")
    with_type_and_head_dim(Q, [&]<typename T, int d>() { fwd_ampere<T, d>(Q, K, V, O, L, causal, scale, stream); });
  else if (kernel == "hopper")
    with_type_and_head_dim(Q, [&]<typename T, int d>() { fwd_hopper<T, d>(Q, K, V, O, L, causal, scale, stream); });
  else
    TORCH_CHECK(false, "unknown kernel '", kernel, "'");
  return {O, L};
}

std::vector<torch::Tensor> backward(const std::string& kernel, const torch::Tensor& Q, const torch::Tensor& K,
                                    const torch::Tensor& V, const torch::Tensor& O, const torch::Tensor& L,
                                    const torch::Tensor& dO, bool causal, double scale, int64_t stream_ptr) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  const int d = Q.size(3);
  auto D = torch::empty_like(L);                                        // (B, H, N) fp32
  auto dQ = torch::zeros_like(Q, Q.options().dtype(torch::kFloat32));   // (B, H, N, d) fp32: atomics add into it
  auto dK = torch::empty_like(K), dV = torch::empty_like(V);            // (B, H, N, d)
  if (kernel == "fp32") {
    launch_preprocess<float>(O, dO, D, stream);
    with_head_dim(d, [&]<int d>() { bwd_fp32<d>(Q, K, V, dO, L, D, dQ, dK, dV, causal, scale, stream); });
  } else if (kernel == "ampere" || kernel == "hopper") {
    with_type_and_head_dim(Q, [&]<typename T, int d>() {
      launch_preprocess<T>(O, dO, D, stream);
      kernel == "ampere" ? bwd_ampere<T, d>(Q, K, V, dO, L, D, dQ, dK, dV, causal, scale, stream)
                         : bwd_hopper<T, d>(Q, K, V, dO, L, D, dQ, dK, dV, causal, scale, stream);
    });
  } else {
    TORCH_CHECK(false, "unknown kernel '", kernel, "'");
  }
  return {dQ, dK, dV};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "O, L = forward(kernel, Q, K, V, causal, scale, stream)");
  m.def("backward", &backward, "dQ, dK, dV = backward(kernel, Q, K, V, O, L, dO, causal, scale, stream)");
}
#endif  // __CUDACC_RTC__
