// A c10d::Backend whose operations are the methods of a Python subclass (collectives/torch_backend).
//
// torch's c10d operators (c10d::allreduce_, c10d::broadcast_, ...) run a ProcessGroup's calls on the
// Backend registered for the tensors' device. A Python subclass of ProcessGroup that defines the
// collectives itself bypasses them (dispatch-level tools such as CommDebugMode see nothing), and
// torch 2.13 gives Python no constructible Backend: this is the trampoline that lets a Python class
// be one. Each virtual calls the Python method of the same name (torch's Python names), under the GIL.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace {

using c10d::Work;

// The Work a Python method returned, kept alive with its Python object (a Python subclass of Work,
// such as a posted receive, lives as long as torch holds the Work).
class PyWorkRef : public Work {
 public:
  explicit PyWorkRef(py::object obj)
      : work_(obj.cast<c10::intrusive_ptr<Work>>()), obj_(std::move(obj)) {}

  ~PyWorkRef() override {
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    return work_->wait(timeout);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return work_->getFuture();
  }
  std::exception_ptr exception() const override {
    return work_->exception();
  }
  std::vector<at::Tensor> result() override {
    return work_->result();
  }
  void synchronize() override {
    work_->synchronize();
  }
  void abort() override {
    work_->abort();
  }
  // these three are Python methods of the Python Work classes (the C++ ones answer through their bindings)
  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return obj_.attr("is_completed")().cast<bool>();
  }
  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return obj_.attr("is_success")().cast<bool>();
  }
  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return obj_.attr("_source_rank")().cast<int>();
  }

 private:
  c10::intrusive_ptr<Work> work_;
  py::object obj_;
};

class PyBackend : public c10d::Backend {
 public:
  PyBackend(int rank, int size, double timeout_s)
      : Backend(rank, size),
        options_(c10::make_intrusive<Options>(
            "moecomm", std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)))) {}

  const std::string getBackendName() const override {
    return "moecomm";
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return options_;
  }

  // The Python method `name` of this object's Python subclass.
  py::function method(const char* name) const {
    py::function f = py::get_override(static_cast<const PyBackend*>(this), name);
    TORCH_CHECK(f, "moecomm: the process group's backend is gone (destroyed), or has no ", name);
    return f;
  }

#define MOECOMM_FORWARD(name, ...)                                   \
  {                                                                  \
    py::gil_scoped_acquire gil;                                      \
    return c10::make_intrusive<PyWorkRef>(method(#name)(__VA_ARGS__)); \
  }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override
      MOECOMM_FORWARD(broadcast, t, o)
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override
      MOECOMM_FORWARD(allreduce, t, o)
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                               const c10d::AllreduceCoalescedOptions& o) override
      MOECOMM_FORWARD(allreduce_coalesced, t, o)
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override
      MOECOMM_FORWARD(reduce, t, o)
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                     const c10d::AllgatherOptions& o) override
      MOECOMM_FORWARD(allgather, out, in, o)
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override
      MOECOMM_FORWARD(_allgather_base, out, in, o)
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                               std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) override
      MOECOMM_FORWARD(allgather_coalesced, out, in, o)
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                           const c10d::AllgatherOptions& o) override
      MOECOMM_FORWARD(allgather_into_tensor_coalesced, out, in, o)
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                  const c10d::GatherOptions& o) override
      MOECOMM_FORWARD(gather, out, in, o)
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                   const c10d::ScatterOptions& o) override
      MOECOMM_FORWARD(scatter, out, in, o)
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                          const c10d::ReduceScatterOptions& o) override
      MOECOMM_FORWARD(reduce_scatter, out, in, o)
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                const c10d::ReduceScatterOptions& o) override
      MOECOMM_FORWARD(_reduce_scatter_base, out, in, o)
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                           const c10d::ReduceScatterOptions& o) override
      MOECOMM_FORWARD(reduce_scatter_tensor_coalesced, out, in, o)
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                         std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override
      MOECOMM_FORWARD(alltoall_base, out, in, out_splits, in_splits, o)
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                    const c10d::AllToAllOptions& o) override
      MOECOMM_FORWARD(alltoall, out, in, o)
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& t, int dst, int tag) override
      MOECOMM_FORWARD(send, t, dst, tag)
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& t, int src, int tag) override
      MOECOMM_FORWARD(recv, t, src, tag)
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override
      MOECOMM_FORWARD(recv_anysource, t, tag)
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override
      MOECOMM_FORWARD(barrier, o)
  c10::intrusive_ptr<Work> endCoalescing() override
      MOECOMM_FORWARD(end_coalescing, py::none())
#undef MOECOMM_FORWARD

  void startCoalescing() override {
    py::gil_scoped_acquire gil;
    method("start_coalescing")(py::none());
  }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    if (py::function f = py::get_override(static_cast<const PyBackend*>(this), "shutdown")) {
      f();
    }
  }
  void abort() override {
    py::gil_scoped_acquire gil;
    if (py::function f = py::get_override(static_cast<const PyBackend*>(this), "abort")) {
      f();
    }
  }

 private:
  c10::intrusive_ptr<Options> options_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<PyBackend, c10d::Backend, c10::intrusive_ptr<PyBackend>>(m, "PyBackend")
      .def(py::init<int, int, double>(), py::arg("rank"), py::arg("size"), py::arg("timeout_s"));
}
