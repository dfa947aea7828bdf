// Exercise 07 on a CPU: just enough of CUDA for starter.cu's kernel to compile as C++ and run with one
// std::thread per CUDA thread (emulate.cpp). This file stands in for the real <cuda_runtime.h> only when
// the grader builds the CPU emulation; nvcc and the GPU build never see it.
//
// What is emulated: __global__/__device__ functions as plain functions; __shared__ arrays as statics
// (one block runs at a time, so its threads share them); threadIdx, blockIdx per thread, gridDim and
// blockDim per launch; __syncthreads() as a barrier of the block's threads (a thread that never reaches
// it is reported, not waited for forever); the float math functions a kernel like this one uses.
// What is not: warp shuffles, atomics, vector types, textures: a kernel using them does not compile
// here (the grader skips the CPU run of one that calls shuffles or atomics) and is graded on a GPU only.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

using std::max;
using std::min;

inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __saturatef(float x) { return std::min(1.f, std::max(0.f, x)); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

// The barrier of the running block: every thread of it must arrive before any leaves. A wait longer than
// a few seconds means some thread of the block will never arrive (a __syncthreads() inside a branch that
// not every thread takes): the emulation says so and stops, where a GPU would hang or misbehave.
struct BlockBarrier {
  std::mutex mutex;
  std::condition_variable cv;
  int threads = 0, arrived = 0;
  long generation = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    const long gen = generation;
    if (++arrived == threads) {
      arrived = 0;
      generation++;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return generation != gen; })) {
      std::fprintf(stderr, "__syncthreads(): %d of the block's %d threads arrived and waited 10 s for the rest: a "
                   "__syncthreads() that not every thread of the block reaches\n", arrived, threads);
      std::_Exit(3);
    }
  }
};
inline BlockBarrier* emulated_block_barrier = nullptr;
inline void __syncthreads() { emulated_block_barrier->wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {}
