// Exercise 07 on a CPU: runs flash_fwd_exercise from starter.cu (included as kernel.inc, cut before its
// extern "C" launcher, whose <<<>>> only nvcc understands) on the CPU. Blocks run one after another;
// the B_r threads of a block run at once, one std::thread each, meeting at __syncthreads() (cuda_runtime.h
// in this folder).
//   emulate N d BH scale_log2 causal in.bin out.bin
// in.bin: Q, K, V as float32 (BH, N, d) one after the other; out.bin: O (BH, N, d) then L (BH, N).
#include "cuda_runtime.h"
#include "kernel.inc"

#include <cstdio>
#include <thread>
#include <vector>

template <int d>
void launch(const float* Q, const float* K, const float* V, float* O, float* L, int BH, int N, float scale_log2,
            bool causal) {
  gridDim = dim3((N + B_r - 1) / B_r, BH);
  blockDim = dim3(B_r);
  for (unsigned by = 0; by < gridDim.y; by++)
    for (unsigned bx = 0; bx < gridDim.x; bx++) {
      BlockBarrier barrier;
      barrier.threads = B_r;
      emulated_block_barrier = &barrier;
      std::vector<std::thread> threads;
      for (int t = 0; t < B_r; t++)
        threads.emplace_back([=] {
          threadIdx = dim3(t);
          blockIdx = dim3(bx, by);
          flash_fwd_exercise<d>(Q, K, V, O, L, N, scale_log2, causal);
        });
      for (auto& th : threads) th.join();
    }
}

int main(int argc, char** argv) {
  if (argc != 8) return std::fprintf(stderr, "usage: emulate N d BH scale_log2 causal in.bin out.bin\n"), 2;
  const int N = std::atoi(argv[1]), d = std::atoi(argv[2]), BH = std::atoi(argv[3]);
  const float scale_log2 = std::strtof(argv[4], nullptr);
  const bool causal = std::atoi(argv[5]) != 0;
  const size_t n = (size_t)BH * N * d;
  std::vector<float> in(3 * n), out(n + (size_t)BH * N, NAN);     // NaN: a row never written shows
  FILE* f = std::fopen(argv[6], "rb");
  if (!f || std::fread(in.data(), sizeof(float), in.size(), f) != in.size()) return std::fprintf(stderr, "bad input\n"), 2;
  std::fclose(f);
  const float *Q = in.data(), *K = Q + n, *V = K + n;
  float *O = out.data(), *L = O + n;
  switch (d) {
    case 16: launch<16>(Q, K, V, O, L, BH, N, scale_log2, causal); break;
    case 32: launch<32>(Q, K, V, O, L, BH, N, scale_log2, causal); break;
    case 64: launch<64>(Q, K, V, O, L, BH, N, scale_log2, causal); break;
    default: return std::fprintf(stderr, "d = %d is not supported: use 16, 32 or 64\n", d), 2;
  }
  f = std::fopen(argv[7], "wb");
  std::fwrite(out.data(), sizeof(float), out.size(), f);
  std::fclose(f);
  return 0;
}
