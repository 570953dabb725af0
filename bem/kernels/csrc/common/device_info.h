// What the bindings ask of the device: multiprocessors, compute capability, shared memory, whether a CUDA
// graph is being captured.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <mutex>
#include <utility>
#include <vector>

#include "torch_checks.h"

namespace bem {

// A device attribute, read once per device (decode calls and the fftconv step are host-bound: no driver query per
// call). Only the attributes cached here may be asked for.
inline int device_attribute(cudaDeviceAttr attribute, int device) {
  struct Cached {
    int sms = 0, cc_major = 0, shared_memory_optin = 0;
  };
  static std::mutex lock;
  static std::vector<Cached> cache;
  std::lock_guard<std::mutex> guard(lock);
  if (device >= (int)cache.size()) cache.resize(device + 1);
  Cached& c = cache[device];
  if (c.sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&c.cc_major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&c.shared_memory_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  }
  switch (attribute) {
    case cudaDevAttrMultiProcessorCount: return c.sms;
    case cudaDevAttrComputeCapabilityMajor: return c.cc_major;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: return c.shared_memory_optin;
    default: BEM_CHECK(false, "device attribute ", (int)attribute, " is not one device_info.h caches");
  }
  return 0;
}

inline int num_sms(int device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); }
inline int cc_major(int device) { return device_attribute(cudaDevAttrComputeCapabilityMajor, device); }
// The shared memory a block may opt in to (the fftconv kernels of long rows need more than the default 48 KB).
inline int shared_memory_optin(int device) {
  return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

// Whether the current stream is being captured into a CUDA graph: a replay does not pay the host's time
// per call, so choices made for host-bound calls do not apply there.
inline bool capturing_now() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream_now(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace bem
