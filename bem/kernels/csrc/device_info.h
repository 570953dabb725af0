// What the bindings ask of the device: multiprocessors, compute capability, whether sm_90a code runs.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <mutex>
#include <utility>
#include <vector>

#include "launchers.h"
#include "torch_checks.h"

namespace bem {

// A device attribute, read once per device (decode calls are host-bound: no driver query per call).
inline int device_attribute(cudaDeviceAttr attribute, int device) {
  static std::mutex lock;
  static std::vector<std::pair<int, int>> cache;  // (multiprocessors, compute capability major)
  std::lock_guard<std::mutex> guard(lock);
  if (device >= (int)cache.size()) cache.resize(device + 1, {0, 0});
  if (cache[device].first == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device].first, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device].second, cudaDevAttrComputeCapabilityMajor, device));
  }
  return attribute == cudaDevAttrMultiProcessorCount ? cache[device].first : cache[device].second;
}

inline int num_sms(int device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); }
inline int cc_major(int device) { return device_attribute(cudaDevAttrComputeCapabilityMajor, device); }

// Whether this build has its sm_90a kernels (the GEMM with the update inside, the TMA update kernel)
// for the device: sm_90a code on a compute capability 9.0 GPU.
inline bool sm90a_runs(int device) {
  bool supported = false;
  C10_CUDA_CHECK(gemm_update_supported(device, stream_now(), &supported));
  return supported;
}

// Whether the current stream is being captured into a CUDA graph: a replay does not pay the host's time
// per call, so choices made for host-bound calls do not apply there.
inline bool capturing_now() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream_now(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace bem
