// The dma schedule's stream memory operations (cco/cuda/memops.py: write, wait_geq, copy) as plain
// driver calls: through cuda-python each call builds a CUstream, a CUdeviceptr and a cuuint64_t
// object and checks a result tuple, which a profile of a decode-sized call at world 2 put at ~8% of
// its host time (docs/decode.md, "World 2, the profile again"). Compiled into the decode calls'
// extension (kernels_fused/hopper/native.py), whose module decode_calls.cpp defines: this file adds
// its functions to that module (add_stream_memops).
//
// As decode_calls.cpp, it needs no CUDA toolkit: the driver is opened with dlopen and its entry
// points found with dlsym, once. The stream memory operations are the ``_v2`` exports: cuda.h maps
// cuStreamWriteValue64 / cuStreamWaitValue64 to them since CUDA 12 (and cuda-python, asking
// cuGetProcAddress for its CUDA 12+ version, gets them too); the unsuffixed exports are the pre-11.7
// entry points, kept for old binaries, whose 64-bit operations some drivers enable only with a
// module parameter. cuMemcpyAsync has one version. None is the per-thread-default-stream (_ptsz)
// variant: a stream of 0 is the legacy default stream, as for cuda-python (unless it is told
// otherwise) and torch.
#include <pybind11/pybind11.h>

#include <dlfcn.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

using CUresult = int;
using CUstream = void*;
using CUdeviceptr = uint64_t;  // unsigned long long on every 64-bit platform the driver supports
constexpr CUresult kSuccess = 0;
constexpr unsigned kWriteValueDefault = 0x0;  // CU_STREAM_WRITE_VALUE_DEFAULT
constexpr unsigned kWaitValueGeq = 0x0;       // CU_STREAM_WAIT_VALUE_GEQ: (int64_t)(*addr - value) >= 0

struct MemOps {
  CUresult (*write_value64)(CUstream, CUdeviceptr, uint64_t, unsigned) = nullptr;
  CUresult (*wait_value64)(CUstream, CUdeviceptr, uint64_t, unsigned) = nullptr;
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
  std::string missing;  // why the driver cannot be used ("" where it can)

  MemOps() {
    // torch has loaded the driver where there is a GPU (RTLD_NOLOAD finds it); else load it
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (lib == nullptr) {
      missing = "libcuda.so.1 cannot be loaded";
      return;
    }
    bind(lib, write_value64, "cuStreamWriteValue64_v2");
    bind(lib, wait_value64, "cuStreamWaitValue64_v2");
    bind(lib, memcpy_async, "cuMemcpyAsync");
    bind(lib, error_name, "cuGetErrorName");
  }

  template <typename F>
  void bind(void* lib, F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (f == nullptr && missing.empty()) missing = std::string("the driver has no ") + name;
  }
};

const MemOps& memops() {
  static const MemOps m;  // once per process (a thread-safe static)
  return m;
}

// The driver usable, or a RuntimeError naming the call that needed it.
const MemOps& usable(const char* what) {
  const MemOps& m = memops();
  if (!m.missing.empty()) throw std::runtime_error(std::string(what) + " failed: " + m.missing);
  return m;
}

// A RuntimeError for a result that is not CUDA_SUCCESS, worded as memops._check words it
// ("cuStreamWriteValue64 failed: CUDA_ERROR_INVALID_VALUE"), so callers match either path's error.
void check(const MemOps& m, CUresult r, const char* what) {
  if (r == kSuccess) return;
  const char* name = nullptr;
  if (m.error_name(r, &name) != kSuccess) name = nullptr;  // a code the driver does not know
  throw std::runtime_error(std::string(what) + " failed: " +
                           (name != nullptr ? std::string(name) : "CUresult " + std::to_string(r)));
}

// The GIL is released around each call, as cuda-python's bindings release it: an enqueue can block
// (a full push buffer behind a wait that only another thread's write releases: cco.cuda.watchdog's
// thread), and that thread needs the GIL to write. A raised error is thrown after the guard's scope
// has taken the GIL back (pybind11 translates it then).
void write_value64(uint64_t stream, uint64_t addr, uint64_t value) {
  const MemOps& m = usable("cuStreamWriteValue64");
  CUresult r;
  {
    py::gil_scoped_release unlocked;
    r = m.write_value64(reinterpret_cast<CUstream>(stream), addr, value, kWriteValueDefault);
  }
  check(m, r, "cuStreamWriteValue64");
}

void wait_value64_geq(uint64_t stream, uint64_t addr, uint64_t value) {
  const MemOps& m = usable("cuStreamWaitValue64");
  CUresult r;
  {
    py::gil_scoped_release unlocked;
    r = m.wait_value64(reinterpret_cast<CUstream>(stream), addr, value, kWaitValueGeq);
  }
  check(m, r, "cuStreamWaitValue64");
}

void memcpy_async(uint64_t stream, uint64_t dst, uint64_t src, uint64_t nbytes) {
  if (nbytes == 0) return;  // memops.copy enqueues nothing for no bytes (this replaces it whole)
  const MemOps& m = usable("cuMemcpyAsync");
  CUresult r;
  {
    py::gil_scoped_release unlocked;
    r = m.memcpy_async(dst, src, static_cast<size_t>(nbytes), reinterpret_cast<CUstream>(stream));
  }
  check(m, r, "cuMemcpyAsync");
}

}  // namespace

// Called by decode_calls.cpp's PYBIND11_MODULE: one extension, one build.
void add_stream_memops(py::module_& m) {
  m.def("stream_write_value64", &write_value64, py::arg("stream"), py::arg("addr"), py::arg("value"),
        "cuStreamWriteValue64(stream, addr, value, CU_STREAM_WRITE_VALUE_DEFAULT); RuntimeError on failure");
  m.def("stream_wait_value64_geq", &wait_value64_geq, py::arg("stream"), py::arg("addr"), py::arg("value"),
        "cuStreamWaitValue64(stream, addr, value, CU_STREAM_WAIT_VALUE_GEQ); RuntimeError on failure");
  m.def("memcpy_async", &memcpy_async, py::arg("stream"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        "cuMemcpyAsync(dst, src, nbytes, stream), nothing for 0 bytes; RuntimeError on failure");
  m.def("memops_missing", []() { return memops().missing; },
        "why the driver's stream memory operations cannot be called here (\"\" where they can)");
}
