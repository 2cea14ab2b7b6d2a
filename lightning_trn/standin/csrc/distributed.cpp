// The stand-in's `neuron` process-group backend: a C++ c10d::Backend, so that DDP, functional collectives,
// DTensor and FSDP2 (which dispatch collectives from C++) all reach it.
//
// It runs each collective with a gloo backend (created in Python: torch ships no gloo headers) on zero-copy CPU
// aliases of the device tensors, waits for it, and returns a completed Work whose results are the device tensors.
// What TorchNeuron's backend lacks is refused as there (its source snapshot, torch_neuronx/distributed/backend.py):
// point-to-point ops, and barriers on groups smaller than the world.
// No data is copied between device and host: as on a real device, collectives do not read the device from the host.
#include "standin.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace standin {
namespace {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<Tensors>;

Tensors aliases(const Tensors& tensors) {
  Tensors out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(host_alias(t));
  return out;
}

TensorLists aliases(const TensorLists& lists) {
  TensorLists out;
  out.reserve(lists.size());
  for (const auto& list : lists) out.push_back(aliases(list));
  return out;
}

// A finished collective: `wait()` returns at once, the future holds the device tensors it wrote.
class DoneWork final : public c10d::Work {
 public:
  DoneWork(Tensors outputs, OpType type)
      : c10d::Work(-1, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  Tensors result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  Tensors outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

c10::intrusive_ptr<c10d::Work> done(const c10::intrusive_ptr<c10d::Work>& work, Tensors outputs, OpType type) {
  work->wait();
  return c10::make_intrusive<DoneWork>(std::move(outputs), type);
}

Tensors flat(const TensorLists& lists) {
  Tensors out;
  for (const auto& list : lists) out.insert(out.end(), list.begin(), list.end());
  return out;
}

void divide(const Tensors& host_outputs, int size) {
  for (const auto& t : host_outputs) {
    if (t.is_floating_point() || t.is_complex()) {
      t.div_(size);
    } else {  // integers average with truncation, as NCCL's ncclAvg does
      t.div_(size, "trunc");
    }
  }
}

// Runs a reduction with gloo, which has no integer AVG: AVG runs as SUM, then the results (`host_outputs`, on the
// ranks that receive them) are divided by the group size.
template <typename Options, typename Run>
c10::intrusive_ptr<c10d::Work> reduce_with(const Options& opts, Run run, Tensors outputs, const Tensors& host_outputs,
                                           OpType type, int size, bool receives = true) {
  auto gloo_opts = opts;
  const bool avg = gloo_opts.reduceOp == c10d::ReduceOp::AVG;
  if (avg) gloo_opts.reduceOp = c10d::ReduceOp::SUM;
  auto work = done(run(gloo_opts), std::move(outputs), type);
  if (avg && receives) divide(host_outputs, size);
  return work;
}

class NeuronBackend final : public c10d::Backend {
 public:
  NeuronBackend(c10::intrusive_ptr<c10d::Backend> gloo, int world_size)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)), world_size_(world_size) {}

  const std::string getBackendName() const override { return "neuron"; }

  // Every collective has finished when it returns, so a coalesced block has nothing left to run at its end.
  void startCoalescing() override {}
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    return c10::make_intrusive<DoneWork>(Tensors{}, OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    auto host = aliases(tensors);
    return done(gloo_->broadcast(host, opts), tensors, OpType::BROADCAST);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    auto host = aliases(tensors);
    auto run = [&](const auto& o) { return gloo_->allreduce(host, o); };
    return reduce_with(opts, run, tensors, host, OpType::ALLREDUCE, getSize());
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(Tensors& tensors,
                                                      const c10d::AllreduceCoalescedOptions& opts) override {
    auto host = aliases(tensors);
    auto run = [&](const auto& o) { return gloo_->allreduce_coalesced(host, o); };
    return reduce_with(opts, run, tensors, host, OpType::ALLREDUCE_COALESCED, getSize());
  }

  c10::intrusive_ptr<c10d::Work> reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    auto host = aliases(tensors);
    auto run = [&](const auto& o) { return gloo_->reduce(host, o); };
    return reduce_with(opts, run, tensors, host, OpType::REDUCE, getSize(), getRank() == opts.rootRank);
  }

  c10::intrusive_ptr<c10d::Work> allgather(TensorLists& outputs, Tensors& inputs,
                                            const c10d::AllgatherOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    return done(gloo_->allgather(host_out, host_in, opts), flat(outputs), OpType::ALLGATHER);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                  const c10d::AllgatherOptions& opts) override {
    auto host_out = host_alias(output);
    auto host_in = host_alias(input);
    return done(gloo_->_allgather_base(host_out, host_in, opts), {output}, OpType::_ALLGATHER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                  const c10d::AllgatherOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    return done(gloo_->allgather_into_tensor_coalesced(host_out, host_in, opts), outputs, OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> gather(TensorLists& outputs, Tensors& inputs,
                                         const c10d::GatherOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    return done(gloo_->gather(host_out, host_in, opts), flat(outputs), OpType::GATHER);
  }

  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outputs, TensorLists& inputs,
                                          const c10d::ScatterOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    return done(gloo_->scatter(host_out, host_in, opts), outputs, OpType::SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors& outputs, TensorLists& inputs,
                                                 const c10d::ReduceScatterOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    auto run = [&](const auto& o) { return gloo_->reduce_scatter(host_out, host_in, o); };
    return reduce_with(opts, run, outputs, host_out, OpType::REDUCE_SCATTER, getSize());
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    auto host_out = host_alias(output);
    auto host_in = host_alias(input);
    auto run = [&](const auto& o) { return gloo_->_reduce_scatter_base(host_out, host_in, o); };
    return reduce_with(opts, run, {output}, {host_out}, OpType::_REDUCE_SCATTER_BASE, getSize());
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    auto run = [&](const auto& o) { return gloo_->reduce_scatter_tensor_coalesced(host_out, host_in, o); };
    return reduce_with(opts, run, outputs, host_out, OpType::COALESCED, getSize());
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& out_splits,
                                                std::vector<int64_t>& in_splits,
                                                const c10d::AllToAllOptions& opts) override {
    auto host_out = host_alias(output);
    auto host_in = host_alias(input);
    return done(gloo_->alltoall_base(host_out, host_in, out_splits, in_splits, opts), {output}, OpType::ALLTOALL_BASE);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outputs, Tensors& inputs,
                                           const c10d::AllToAllOptions& opts) override {
    auto host_out = aliases(outputs);
    auto host_in = aliases(inputs);
    return done(gloo_->alltoall(host_out, host_in, opts), outputs, OpType::ALLTOALL);
  }

  c10::intrusive_ptr<c10d::Work> send(Tensors&, int, int) override { point_to_point("send"); }
  c10::intrusive_ptr<c10d::Work> recv(Tensors&, int, int) override { point_to_point("recv"); }
  c10::intrusive_ptr<c10d::Work> recvAnysource(Tensors&, int) override { point_to_point("recv"); }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    TORCH_CHECK_NOT_IMPLEMENTED(getSize() == world_size_, "Barrier is implemented only for default group, called "
                                "barrier on a group of ", getSize(), " of ", world_size_, " ranks (neuron stand-in, "
                                "as TorchNeuron's backend)");
    return done(gloo_->barrier(opts), {}, OpType::BARRIER);
  }

 private:
  [[noreturn]] static void point_to_point(const char* op) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "torch.distributed ", op, " is not supported by the neuron backend (neuron "
                                "stand-in, as TorchNeuron's backend: it has no point-to-point ops)");
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  int world_size_;
};

}  // namespace

void bind_distributed(pybind11::module& m) {
  m.def(
      "neuron_backend",
      [](const c10::intrusive_ptr<c10d::Backend>& gloo, int world_size) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<NeuronBackend>(gloo, world_size);
      },
      "The `neuron` process-group backend over a gloo backend of the same group, in a job of `world_size` ranks.");
}

}  // namespace standin
