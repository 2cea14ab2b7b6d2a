// CPU stand-in for TorchNeuron's native `neuron` device (PyTorch PrivateUse1, renamed to "neuron" from Python).
//
// Device memory is host memory. A handful of kernels are native to the device (creation, views, copies, scalar
// reads, dropout, the fused RNN cells PyTorch asks a PrivateUse1 device for); every other op runs its CPU kernel
// through a boxed fallback that first checks that the op does not mix devices, as a real accelerator would refuse
// to, then hands the kernel zero-copy CPU aliases of the device tensors, so what it writes, views and resizes is
// the device's (`HostCall`; `*_overrideable` convolutions, which have no CPU kernel, go through a twin op:
// `twin_of`). Counters record device->host copies, scalar reads and the ops
// the fallback served, by name, and host syncs: the waits for the device that an asynchronous device would have
// (blocking copies to the host, scalar reads, synchronize calls; a `non_blocking` copy into pinned memory is a
// transfer but no wait). Ops named in set_host_ops() act as the real device's CPU-fallback ops (their arguments and
// results count as transfers); strict mode raises on any device->host read. Written against PyTorch 2.13.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "standin.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <unordered_map>

namespace standin {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;

constexpr DeviceType kNeuron = DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ---------------------------------------------------------------------------------------------- devices
std::atomic<int> g_device_count{1};
thread_local DeviceIndex t_current_device = 0;

void check_index(DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < g_device_count.load(),
      "Invalid device index neuron:", static_cast<int>(index), ": the stand-in has ", g_device_count.load(),
      " device(s) (set LIGHTNING_TRN_STANDIN_DEVICES before loading it for more).");
}

// ---------------------------------------------------------------------------------------------- counters
std::atomic<int64_t> g_device_to_host{0};
std::atomic<int64_t> g_host_to_device{0};
std::atomic<int64_t> g_host_to_device_bytes{0};
std::atomic<int64_t> g_scalar_reads{0};
std::atomic<int64_t> g_host_syncs{0};
std::atomic<bool> g_strict{false};
std::mutex g_fallback_mutex;
std::map<std::string, int64_t> g_fallback_counts;
// Ops (by name, any overload) the stand-in treats as missing on the device, like TorchNeuron's CPU fallback ops:
// their copies are counted as transfers, and each call is counted here by full name.
std::set<std::string> g_host_ops;
std::map<std::string, int64_t> g_host_op_counts;
void on_device_read(const char* what, const at::Tensor& tensor, std::atomic<int64_t>& counter) {
  TORCH_CHECK(
      !g_strict.load(), "lightning_trn.standin strict mode: a device->host read (", what, " of a ",
      tensor.sizes(), " ", tensor.scalar_type(), " tensor on ", tensor.device(),
      ") happened inside lightning_trn.standin.strict(). On a real Neuron device it would stall the host "
      "until the device catches up; move the read out of the step or to a logging point.");
  counter++;
}

// The host waits for the device: what stalls an asynchronous device's host thread.
void on_host_sync() { g_host_syncs++; }

// ---------------------------------------------------------------------------------------------- allocator
struct Block {
  size_t size;
  DeviceIndex device;
};

// 64-byte aligned host memory for `nbytes` (> 0) bytes; `what` names the allocation in the out-of-memory error.
void* allocate_host(size_t nbytes, const char* what) {
  void* data = std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
  TORCH_CHECK_WITH(OutOfMemoryError, data != nullptr, "neuron stand-in: out of host memory ", what, " ", nbytes,
                   " bytes");
  return data;
}

// The entry of `blocks` (keyed by start address) whose block holds `ptr`, or nullptr; `size` gives an entry's bytes.
template <typename Entry, typename Size>
const Entry* block_holding(const std::map<const void*, Entry>& blocks, const void* ptr, Size size) {
  auto it = blocks.upper_bound(ptr);
  if (it == blocks.begin()) return nullptr;
  --it;
  return static_cast<const char*>(ptr) < static_cast<const char*>(it->first) + size(it->second) ? &it->second
                                                                                                 : nullptr;
}

// The Neuron runtime starts with the first device tensor (TorchNeuron: `empty_strided_neuron` -> `neuron_init`), not
// with device_count(), set_device() or seeding. `init_process_group("neuron")` asserts it has not started yet, and a
// process forked after it started may not use the device (TorchNeuron means to refuse that as CUDA does).
std::atomic<bool> g_runtime_initialized{false};
std::atomic<bool> g_in_bad_fork{false};

void mark_bad_fork() {
  if (g_runtime_initialized.load()) g_in_bad_fork = true;
}

void start_runtime() {
  TORCH_CHECK(!g_in_bad_fork.load(),
              "Cannot re-initialize Neuron runtime in forked subprocess. To use Neuron with multiprocessing, use the "
              "'spawn' start method (neuron stand-in, as TorchNeuron and CUDA)");
  g_runtime_initialized = true;
}

class HostMemoryAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const DeviceIndex device = t_current_device;
    check_index(device);
    start_runtime();
    void* data = nullptr;
    if (nbytes > 0) {
      data = allocate_host(nbytes, "allocating");
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[data] = Block{nbytes, device};
      update(device, static_cast<int64_t>(nbytes), 1);
    }
    return {data, data, &HostMemoryAllocator::deleter, Device(kNeuron, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostMemoryAllocator::deleter; }

  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached: freed blocks go straight back to the OS
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }
  void resetAccumulatedStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* array : arrays(stats_[device]))
      for (auto& stat : *array) stat.reset_accumulated();
  }
  void resetPeakStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* array : arrays(stats_[device]))
      for (auto& stat : *array) stat.reset_peak();
  }

  // The device a pointer into device memory belongs to (for `getDeviceFromPtr`).
  std::optional<DeviceIndex> device_of(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Block* block = block_holding(blocks_, ptr, [](const Block& b) { return b.size; });
    if (block == nullptr) return std::nullopt;
    return block->device;
  }

 private:
  static void deleter(void* ptr);

  static std::array<c10::CachingAllocator::StatArray*, 4> arrays(c10::CachingDeviceAllocator::DeviceStats& s) {
    return {&s.allocation, &s.segment, &s.allocated_bytes, &s.reserved_bytes};
  }

  // Every block is its own segment and fully in use: allocated == reserved == active.
  void update(DeviceIndex device, int64_t bytes, int64_t count) {
    auto& s = stats_[device];
    for (auto* array : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes})
      for (auto& stat : *array) bytes >= 0 ? stat.increase(bytes) : stat.decrease(-bytes);
    for (auto* array : {&s.allocation, &s.segment, &s.active})
      for (auto& stat : *array) count >= 0 ? stat.increase(count) : stat.decrease(-count);
    count >= 0 ? s.num_device_alloc++ : s.num_device_free++;
  }

  std::mutex mutex_;
  std::map<const void*, Block> blocks_;
  c10::CachingDeviceAllocator::DeviceStats stats_[kMaxDevices];
};

HostMemoryAllocator g_allocator;

void HostMemoryAllocator::deleter(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_allocator.mutex_);
    auto it = g_allocator.blocks_.find(ptr);
    if (it != g_allocator.blocks_.end()) {
      g_allocator.update(it->second.device, -static_cast<int64_t>(it->second.size), -1);
      g_allocator.blocks_.erase(it);
    }
  }
  std::free(ptr);
}

REGISTER_ALLOCATOR(kNeuron, &g_allocator);

// Pinned (page-locked) host memory, which a real device copies to and from without the host waiting: PyTorch
// allocates it for `pin_memory()` and for `.to("cpu", non_blocking=True)`. Plain host memory here, remembered so
// that `is_pinned()` is true for it.
class PinnedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nullptr;
    if (nbytes > 0) {
      data = allocate_host(nbytes, "pinning");
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = nbytes;
    }
    return {data, data, &PinnedHostAllocator::deleter, Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &PinnedHostAllocator::deleter; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }

  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return block_holding(sizes_, ptr, [](size_t nbytes) { return nbytes; }) != nullptr;
  }

 private:
  static void deleter(void* ptr);
  std::mutex mutex_;
  std::map<const void*, size_t> sizes_;
};

PinnedHostAllocator g_pinned_allocator;

void PinnedHostAllocator::deleter(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_allocator.mutex_);
    g_pinned_allocator.sizes_.erase(ptr);
  }
  std::free(ptr);
}

// ---------------------------------------------------------------------------------------------- guard, streams, events
// The stand-in is synchronous: one default stream per device, events carry the host time they were recorded at.
struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kNeuron; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kNeuron, t_current_device); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    if (d.has_index()) {
      check_index(d.index());
      t_current_device = d.index();
    }
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.has_index()) t_current_device = d.index();
  }
  c10::Stream getStream(Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(Device d, bool) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(g_device_count.load()); }

  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new double(0.0);
    *static_cast<double*>(*event) =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { delete static_cast<double*>(event); }
  void synchronizeEvent(void*) const override { on_host_sync(); }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { on_host_sync(); }
  void synchronizeDevice(const DeviceIndex) const override { on_host_sync(); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "both events must be recorded before elapsed_time()");
    return *static_cast<double*>(end) - *static_cast<double*>(start);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------------------------------------- generators
// A `neuron` generator keeps its state in a CPU generator twin: the CPU kernels behind the fallback only accept
// CPU generators, so the fallback hands them the twin. Random ops on the device draw from the device's
// generator, never from the CPU one.
struct NeuronGenerator final : public c10::GeneratorImpl {
  explicit NeuronGenerator(DeviceIndex device, at::Generator cpu)
      : c10::GeneratorImpl(Device(kNeuron, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(std::move(cpu)) {}
  explicit NeuronGenerator(DeviceIndex device)
      : NeuronGenerator(device, at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}

  void set_current_seed(uint64_t seed) override { cpu_.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu_.set_offset(offset); }
  uint64_t get_offset() const override { return cpu_.get_offset(); }
  uint64_t current_seed() const override { return cpu_.current_seed(); }
  uint64_t seed() override { return cpu_.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu_.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu_.unsafeGetGeneratorImpl()->get_state();
  }
  NeuronGenerator* clone_impl() const override { return new NeuronGenerator(device_.index(), cpu_.clone()); }

  at::Generator cpu_;
};

const at::Generator& default_generator(DeviceIndex device) {
  static std::once_flag once;
  static std::vector<at::Generator> generators;
  std::call_once(once, [] {
    for (int i = 0; i < kMaxDevices; ++i) generators.push_back(at::make_generator<NeuronGenerator>(i));
  });
  const DeviceIndex index = device < 0 ? t_current_device : device;
  check_index(index);
  return generators[index];
}

// ---------------------------------------------------------------------------------------------- hooks
struct Hooks final : public at::PrivateUse1HooksInterface {
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_device_count.load() > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(g_device_count.load()); }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    t_current_device = d;
  }
  DeviceIndex getCurrentDevice() const override { return t_current_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    const DeviceIndex old = t_current_device;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void* data) const override { return g_pinned_allocator.contains(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  // Storage resizing in place (FSDP2 frees and re-allocates its unsharded parameters this way).
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_size) const override {
    TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
    const c10::DeviceGuard guard(storage.device());
    c10::DataPtr data = g_allocator.allocate(new_size);
    const size_t kept = std::min(new_size, storage.nbytes());
    if (kept > 0) std::memcpy(data.get(), storage.data(), kept);
    storage.set_data_ptr_noswap(std::move(data));
    storage.set_nbytes(new_size);
  }
  Device getDeviceFromPtr(void* data) const override {
    auto device = g_allocator.device_of(data);
    TORCH_CHECK(device.has_value(), "pointer ", data, " is not in neuron stand-in memory");
    return Device(kNeuron, *device);
  }
  const at::Generator& getDefaultGenerator(DeviceIndex device) const override { return default_generator(device); }
  at::Generator getNewGenerator(DeviceIndex device) const override {
    return at::make_generator<NeuronGenerator>(device < 0 ? t_current_device : device);
  }
};

// ---------------------------------------------------------------------------------------------- native kernels
at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  at::Tensor host = at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
  host._set_conj(t.is_conj());  // conjugate and negative views copy as such
  host._set_neg(t.is_neg());
  return host;
}

void check_empty_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "neuron supports strided tensors only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU tensors can be pinned");
}

// As the CPU's `empty`: under torch.use_deterministic_algorithms new memory holds NaN (or the integer maximum).
at::Tensor filled_if_deterministic(at::Tensor t) {
  if (at::globalContext().deterministicAlgorithms() && at::globalContext().deterministicFillUninitializedMemory())
    at::native::fill_empty_deterministic_(t);
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  check_empty_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return filled_if_deterministic(at::detail::empty_generic(
      size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype),
      memory_format));
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<Device> device,
                         std::optional<bool> pin_memory) {
  check_empty_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return filled_if_deterministic(at::detail::empty_strided_generic(
      size, stride, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype)));
}

// Known-zero tensors (autograd's zero gradients) own no memory, as on CUDA; the CPU's cannot be copied over.
at::Tensor efficient_zero_tensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                 std::optional<c10::Layout> layout, std::optional<Device> device,
                                 std::optional<bool> pin_memory) {
  check_empty_options(layout, pin_memory);
  Device target = c10::device_or_default(device);
  if (!target.has_index()) target.set_index(t_current_device);
  at::native::ZeroTensorAllocator allocator(target);
  const auto keys =
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, &allocator, keys, c10::dtype_or_default(dtype), std::nullopt);
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (self.is_privateuseone() && dst.is_cpu()) {
    on_device_read("copy to the host", self, g_device_to_host);
    if (!non_blocking) on_host_sync();
  }
  if (self.is_cpu() && dst.is_privateuseone()) {
    g_host_to_device++;
    g_host_to_device_bytes += static_cast<int64_t>(self.nbytes());
  }
  at::Tensor dst_host = host_alias(dst);
  at::native::copy_(dst_host, host_alias(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  on_device_read("scalar read (.item())", self, g_scalar_reads);
  on_host_sync();
  return at::native::_local_scalar_dense_cpu(host_alias(self));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }
at::Tensor& set_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, std::move(source)); }
at::Tensor& set_storage_offset(at::Tensor& self, at::Storage storage, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  return at::cpu::set_(self, std::move(storage), offset, size, stride);
}

// Dropout draws its mask from the device's generator (the CPU kernel would draw from the CPU one).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0 || !train.value_or(true) || p == 0) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  if (p == 1) return {at::zeros_like(input), at::zeros_like(input, input.options().dtype(at::kBool))};
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  mask.bernoulli_(1 - p, default_generator(input.device().index()));
  return {input * mask * (1.0 / (1 - p)), mask};
}

// PyTorch's LSTM and GRU layers call fused cells on a PrivateUse1 device (as on CUDA), which have no CPU kernel.
// These compute what the CPU's unfused cells compute, op by op in the same order (gates = (h W_hh^T + b_hh) +
// (x W_ih^T + b_ih)), and their backwards what autograd computes through those ops (the same backward kernels),
// from what CUDA's kernels keep: the activated gates (LSTM), or the gates, hx and the hidden new-gate input (GRU).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(const at::Tensor& input_gates,
                                                               const at::Tensor& hidden_gates, const at::Tensor& cx,
                                                               const std::optional<at::Tensor>& input_bias,
                                                               const std::optional<at::Tensor>& hidden_bias) {
  const bool bias = input_bias.has_value() && input_bias->defined();
  at::Tensor gates = bias ? (hidden_gates + *hidden_bias).add_(input_gates + *input_bias) : hidden_gates + input_gates;
  auto chunks = gates.unsafe_chunk(4, 1);  // activated in place: `gates` becomes the workspace
  const at::Tensor ingate = chunks[0].sigmoid_(), forgetgate = chunks[1].sigmoid_(), cellgate = chunks[2].tanh_(),
                   outgate = chunks[3].sigmoid_();
  at::Tensor cy = (forgetgate * cx).add_(ingate * cellgate);
  at::Tensor hy = outgate * cy.tanh();
  return {hy, cy, gates};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, const at::Tensor& cx,
    const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  const bool hy_grad = grad_hy.has_value() && grad_hy->defined(), cy_grad = grad_cy.has_value() && grad_cy->defined();
  if (!hy_grad && !cy_grad) return {};
  auto gates = workspace.chunk(4, 1);
  const at::Tensor &ig = gates[0], &fg = gates[1], &cg = gates[2], &og = gates[3];
  const at::Tensor tanh_cy = cy.tanh();
  const at::Tensor go = hy_grad ? *grad_hy : at::zeros_like(cx);
  at::Tensor gcy = at::tanh_backward(go * og, tanh_cy);  // hy = og * tanh(cy)
  if (cy_grad) gcy = gcy + *grad_cy;
  at::Tensor grad_gates = at::cat({at::sigmoid_backward(gcy * cg, ig), at::sigmoid_backward(gcy * cx, fg),
                                   at::tanh_backward(gcy * ig, cg), at::sigmoid_backward(go * tanh_cy, og)}, 1);
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {grad_gates, gcy * fg, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                                  const at::Tensor& hx, const std::optional<at::Tensor>& input_bias,
                                                  const std::optional<at::Tensor>& hidden_bias) {
  const bool bias = input_bias.has_value() && input_bias->defined();
  const auto igates = (bias ? input_gates + *input_bias : input_gates).unsafe_chunk(3, 1);
  const auto hgates = (bias ? hidden_gates + *hidden_bias : hidden_gates).unsafe_chunk(3, 1);
  const at::Tensor reset_gate = (hgates[0] + igates[0]).sigmoid_();
  const at::Tensor input_gate = (hgates[1] + igates[1]).sigmoid_();
  const at::Tensor new_gate = igates[2].add(hgates[2] * reset_gate).tanh_();
  at::Tensor hy = (hx - new_gate).mul_(input_gate).add_(new_gate);
  return {hy, at::cat({reset_gate, input_gate, new_gate, hx, hgates[2]}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  auto saved = workspace.chunk(5, 1);
  const at::Tensor &rg = saved[0], &ig = saved[1], &ng = saved[2], &hx = saved[3], &hn = saved[4];
  // hy = (hx - ng) * ig + ng, ng = tanh(in + hn * rg)
  const at::Tensor gin = at::tanh_backward(grad_hy - grad_hy * ig, ng);
  const at::Tensor grg = at::sigmoid_backward(gin * hn, rg);
  const at::Tensor gig = at::sigmoid_backward(grad_hy * (hx - ng), ig);
  at::Tensor grad_input_gates = at::cat({grg, gig, gin}, 1), grad_hidden_gates = at::cat({grg, gig, gin * rg}, 1);
  at::Tensor grad_input_bias, grad_hidden_bias;
  if (has_bias) {
    grad_input_bias = grad_input_gates.sum(0);
    grad_hidden_bias = grad_hidden_gates.sum(0);
  }
  return {grad_input_gates, grad_hidden_gates, grad_hy * ig, grad_input_bias, grad_hidden_bias};
}

// scaled_dot_product_attention asks a device's `_fused_sdp_choice_stub` which kernel to run and takes the math
// decomposition on a device without one: answer as the CPU does, so attention runs the CPU's kernels (flash).
int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  return at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

// ---------------------------------------------------------------------------------------------- CPU fallback
[[noreturn]] void mixed_devices(const c10::OperatorHandle& op, const std::string& argument, Device a, Device b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a,
              " and ", b, "! (when checking argument ", argument, " in method ", op.schema().operator_name(),
              ")");
}

// Refuse what a real device refuses: a tensor on the CPU (other than a 0-dim "scalar" tensor, or an index
// tensor) or on another neuron device next to device tensors. Returns the op's neuron device, if any.
std::optional<Device> check_devices(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const auto begin = stack.size() - args.size();
  std::optional<Device> neuron, cpu;
  std::string cpu_argument;
  auto visit = [&](const at::Tensor& t, const std::string& name, bool index) {
    if (!t.defined()) return;
    if (t.is_privateuseone()) {
      if (neuron && *neuron != t.device()) mixed_devices(op, name, *neuron, t.device());
      neuron = t.device();
    } else if (t.dim() > 0 && !index && !cpu) {
      cpu = t.device();
      cpu_argument = name;
    }
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& value = stack[begin + i];
    const auto& name = args[i].name();
    if (value.isTensor()) {
      visit(value.toTensor(), name, false);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) visit(t, name, false);
    } else if (value.isList()) {  // Tensor?[] holds the indices of index/index_put: CPU ones are allowed
      for (const c10::IValue& item : value.toListRef())
        if (item.isTensor()) visit(item.toTensor(), name, true);
    }
  }
  if (neuron && cpu) mixed_devices(op, cpu_argument, *neuron, *cpu);
  return neuron;
}

// Random ops take their generator from the device: a missing one becomes the device's default generator, a
// neuron one its CPU twin (the CPU kernels accept no other).
void use_device_generators(const c10::OperatorHandle& op, torch::jit::Stack& stack, DeviceIndex device) {
  const auto& args = op.schema().arguments();
  const auto begin = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& type = args[i].type();
    const bool is_generator = type->kind() == c10::TypeKind::GeneratorType ||
        (type->kind() == c10::TypeKind::OptionalType &&
         type->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::GeneratorType);
    if (!is_generator) continue;
    auto& value = stack[begin + i];
    if (value.isNone()) {
      value = c10::IValue(default_generator(device).get<NeuronGenerator>()->cpu_);
    } else if (value.toGenerator().device().type() == kNeuron) {
      value = c10::IValue(value.toGenerator().get<NeuronGenerator>()->cpu_);
    }
  }
}

// `*_overrideable` convolutions are extension points without a CPU kernel: a twin whose CPU kernel does the same,
// `convolution`(_backward), serves them, as a backend with its own convolution kernels (TorchNeuron) does.
// Rewrites `stack` to the twin's arguments and returns the twin, or nullptr to serve `op` itself.
const c10::OperatorHandle* twin_of(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const auto& name = op.schema().operator_name().name;
  const auto begin = static_cast<std::ptrdiff_t>(stack.size() - op.schema().arguments().size());
  auto& dispatcher = c10::Dispatcher::singleton();
  if (name == "aten::convolution_overrideable") {  // the same arguments
    static const auto convolution = dispatcher.findSchemaOrThrow("aten::convolution", "");
    return &convolution;
  }
  if (name == "aten::convolution_backward_overrideable") {
    // convolution_backward also takes the bias's sizes (after `weight`): [output channels] when its gradient is asked
    const at::Tensor weight = stack[begin + 2].toTensor();
    const bool transposed = stack[begin + 6].toBool();
    const int64_t groups = stack[begin + 8].toInt();
    c10::IValue bias_sizes;
    if (stack[begin + 9].toBoolList().get(2)) {
      bias_sizes = c10::IValue(std::vector<int64_t>{transposed ? weight.size(1) * groups : weight.size(0)});
    }
    stack.insert(stack.begin() + begin + 3, std::move(bias_sizes));
    static const auto backward = dispatcher.findSchemaOrThrow("aten::convolution_backward", "");
    return &backward;
  }
  return nullptr;
}

bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) && a.storage_offset() == b.storage_offset();
}

// A `key` tensor over `storage` with `like`'s dtype, sizes, strides, offset and math bits.
at::Tensor tensor_over(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  t._set_conj(like.is_conj());
  t._set_neg(like.is_neg());
  return t;
}

// One op served by its CPU kernel on zero-copy host aliases of its device tensors. Device memory is host memory, so
// nothing is copied in: what the kernel writes into an argument (declared mutable or not: `native_batch_norm`'s
// running statistics) is written on the device, a view it returns is the same view of the device tensor, and
// arguments that are the same tensor, or overlap, on the device are so on the host (in-place checks, overlap
// errors and results equal the CPU's). An argument the kernel resizes (an `out=` tensor) gets the new memory and
// strides on the device; new results are copied to the device once per storage, keeping their strides.
class HostCall {
 public:
  explicit HostCall(std::optional<Device> device) : device_(device) {}

  // The host alias of a device tensor (other tensors are returned as they are): one per tensor object, over one
  // resizable host storage per device storage.
  at::Tensor to_host(const at::Tensor& t) {
    if (!t.defined() || !t.is_privateuseone()) return t;
    auto known = by_device_.find(t.unsafeGetTensorImpl());
    if (known != by_device_.end()) return tensors_[known->second].second;
    const c10::Storage& storage = t.storage();
    auto it = storages_.find(storage.unsafeGetStorageImpl());
    if (it == storages_.end()) {
      c10::Storage host(c10::Storage::use_byte_size_t(), storage.nbytes(),
                        c10::DataPtr(storage.mutable_data(), Device(c10::kCPU)), c10::GetCPUAllocator(),
                        storage.resizable());
      it = storages_.emplace(storage.unsafeGetStorageImpl(), std::make_pair(storage, std::move(host))).first;
    }
    at::Tensor host = tensor_over(it->second.second, c10::DispatchKey::CPU, t);
    by_device_[t.unsafeGetTensorImpl()] = tensors_.size();
    by_host_[host.unsafeGetTensorImpl()] = tensors_.size();
    tensors_.emplace_back(t, host);
    return host;
  }

  // Brings what the kernel did to the arguments to the device: host storages it reallocated (to resize an argument)
  // give the device storage their bytes, and arguments it resized, restrided or pointed elsewhere follow.
  void write_back() {
    for (auto& [impl, pair] : storages_) {
      auto& [device, host] = pair;
      if (host.data() == device.data() && host.nbytes() == device.nbytes()) continue;
      const c10::DeviceGuard guard(device.device());
      c10::DataPtr data = g_allocator.allocate(host.nbytes());
      if (host.nbytes() > 0) std::memcpy(data.get(), host.data(), host.nbytes());
      device.set_data_ptr_noswap(std::move(data));
      device.set_nbytes(host.nbytes());
    }
    for (auto& [device, host] : tensors_) {
      if (host.storage().unsafeGetStorageImpl() != storages_.at(device.storage().unsafeGetStorageImpl()).second
                                                       .unsafeGetStorageImpl()) {
        at::cpu::set_(device, device_storage(host.storage(), device.device()), host.storage_offset(), host.sizes(),
                      host.strides());
      } else if (!same_geometry(device, host)) {
        device.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
      }
    }
  }

  // A result of the kernel on the device: an argument itself, a view of an argument's memory, or new memory copied
  // to the device (results stay on the host when no device is the target: a CPU `device=` argument).
  at::Tensor to_device(const at::Tensor& r) {
    if (!r.defined() || !r.is_cpu()) return r;
    auto known = by_host_.find(r.unsafeGetTensorImpl());
    if (known != by_host_.end()) return tensors_[known->second].first;
    if (!device_ || device_->type() != kNeuron) return r;
    if (r.layout() != c10::kStrided) return r.to(*device_);  // sparse: refused as the device has no such kernels
    return tensor_over(device_storage(r.storage(), *device_), c10::DispatchKey::PrivateUse1, r);
  }

 private:
  // The device storage behind a host storage: the one it aliases, or a copy on `where` made once per call.
  c10::Storage device_storage(const c10::Storage& host, Device where) {
    for (auto& [impl, pair] : storages_)
      if (pair.second.unsafeGetStorageImpl() == host.unsafeGetStorageImpl()) return pair.first;
    auto copied = copies_.find(host.unsafeGetStorageImpl());
    if (copied != copies_.end()) return copied->second;
    const c10::DeviceGuard guard(where);
    c10::Storage device(c10::Storage::use_byte_size_t(), host.nbytes(), &g_allocator, /*resizable=*/true);
    if (host.nbytes() > 0) std::memcpy(device.mutable_data(), host.data(), host.nbytes());
    copies_.emplace(host.unsafeGetStorageImpl(), device);
    return device;
  }

  std::optional<Device> device_;
  std::vector<std::pair<at::Tensor, at::Tensor>> tensors_;  // (device tensor, its host alias)
  std::unordered_map<const c10::TensorImpl*, size_t> by_device_, by_host_;
  std::unordered_map<const c10::StorageImpl*, std::pair<c10::Storage, c10::Storage>> storages_;  // device, host
  std::unordered_map<const c10::StorageImpl*, c10::Storage> copies_;  // host result storage -> device copy
};

// Calls `op`'s CPU kernel on `stack` through a HostCall. A `host_op` is run as TorchNeuron runs ops without a device
// kernel: every device tensor argument counts as read by the host, every device result as written back.
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::optional<Device> device, bool host_op) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto begin = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {  // a `device=` argument is where the results go
    auto& value = (*stack)[begin + i];
    if (value.isDevice()) {
      device = value.toDevice();
      if (device->type() == kNeuron) value = c10::IValue(Device(c10::kCPU));
    }
  }
  auto read = [&](const at::Tensor& t) {
    if (host_op && t.defined() && t.is_privateuseone()) {
      on_device_read("argument copy of a CPU-fallback op", t, g_device_to_host);
      on_host_sync();
    }
  };
  HostCall call(device);
  for (size_t i = 0; i < args.size(); ++i) {
    auto& value = (*stack)[begin + i];
    if (value.isTensor()) {
      read(value.toTensor());
      value = call.to_host(value.toTensor());
    } else if (value.isTensorList()) {  // new lists: the caller may hold the ones on the stack
      c10::List<at::Tensor> host;
      for (const at::Tensor& t : value.toTensorList()) {
        read(t);
        host.push_back(call.to_host(t));
      }
      value = c10::IValue(std::move(host));
    } else if (value.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> host;
      for (const std::optional<at::Tensor>& t : value.toOptionalTensorList()) {
        if (t.has_value()) read(*t);
        host.push_back(t.has_value() ? std::optional<at::Tensor>(call.to_host(*t)) : std::nullopt);
      }
      value = c10::IValue(std::move(host));
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  call.write_back();
  const auto returns_begin = stack->size() - schema.returns().size();
  int64_t written = 0;
  for (size_t i = 0; i < schema.returns().size(); ++i) {
    auto& value = (*stack)[returns_begin + i];
    if (value.isTensor()) {
      const at::Tensor host = value.toTensor();
      value = call.to_device(host);
      written += value.toTensor().is_privateuseone() ? 1 : 0;
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, call.to_device(list.get(j)));
        written += list.get(j).defined() && list.get(j).is_privateuseone() ? 1 : 0;
      }
    }
  }
  if (host_op) g_host_to_device += written;
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto device = check_devices(op, *stack);
  bool host_op = false;
  {
    std::lock_guard<std::mutex> lock(g_fallback_mutex);
    const auto& name = op.schema().operator_name();
    const auto full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    g_fallback_counts[full]++;
    host_op = g_host_ops.count(name.name) > 0;
    if (host_op) g_host_op_counts[full]++;
  }
  use_device_generators(op, *stack, device ? device->index() : t_current_device);
  const c10::OperatorHandle* twin = twin_of(op, *stack);
  run_on_host(twin != nullptr ? *twin : op, stack, device, host_op);
}

// Ops with their own CPU kernel that a PrivateUse1 device would get as a composite kernel instead (a decomposition
// with other numerics or checks: `native_layer_norm`, `native_group_norm`, `silu_backward`, ...) are served by the
// fallback, so the CPU kernel runs as on the CPU. Found in the dispatcher, once, when the extension loads.
void serve_cpu_kernels_over_composites() {
  static torch::Library* library =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    const auto op = dispatcher.findOp(name);
    if (name.name.rfind("aten::", 0) != 0 || !op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      const auto short_name = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      library->impl(short_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
    }
  }
}

// ---------------------------------------------------------------------------------------------- Python API
void set_device_count(int count) {
  TORCH_CHECK(count >= 1 && count <= kMaxDevices, "device count must be in [1, ", kMaxDevices, "], got ", count);
  g_device_count = count;
}

pybind11::dict counters() {
  pybind11::dict out;
  out["device_to_host"] = g_device_to_host.load();
  out["host_to_device"] = g_host_to_device.load();
  out["host_to_device_bytes"] = g_host_to_device_bytes.load();
  out["scalar_reads"] = g_scalar_reads.load();
  out["host_syncs"] = g_host_syncs.load();
  return out;
}

std::map<std::string, int64_t> fallback_counts() {
  std::lock_guard<std::mutex> lock(g_fallback_mutex);
  return g_fallback_counts;
}

std::map<std::string, int64_t> host_op_counts() {
  std::lock_guard<std::mutex> lock(g_fallback_mutex);
  return g_host_op_counts;
}

std::vector<std::string> set_host_ops(const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(g_fallback_mutex);
  std::vector<std::string> previous(g_host_ops.begin(), g_host_ops.end());
  g_host_ops = std::set<std::string>(names.begin(), names.end());
  return previous;
}

void reset_counters() {
  g_device_to_host = 0;
  g_host_to_device = 0;
  g_host_to_device_bytes = 0;
  g_scalar_reads = 0;
  g_host_syncs = 0;
  std::lock_guard<std::mutex> lock(g_fallback_mutex);
  g_fallback_counts.clear();
  g_host_op_counts.clear();
}

// TorchNeuron's rule (its aten registration for PrivateUse1): `.data` of a CPU tensor may be set to a neuron tensor
// and back, as between CPU and CUDA; torch's own check lists only in-tree backends. FSDP2's `fully_shard` moves a
// module built on the host to the device that way.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  const auto a = self.device().type();
  const auto b = from.device().type();
  return a == b || (a == at::kCPU && b == at::kPrivateUse1) || (a == at::kPrivateUse1 && b == at::kCPU);
}

void register_hooks() {
  static Hooks* hooks = new Hooks();  // lives for the process, as PyTorch expects
  at::RegisterPrivateUse1HooksInterface(hooks);
  pthread_atfork(nullptr, nullptr, &mark_bad_fork);
}

}  // namespace standin

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &standin::empty_memory_format);
  m.impl("empty_strided", &standin::empty_strided);
  m.impl("_efficientzerotensor", &standin::efficient_zero_tensor);
  m.impl("as_strided", &standin::as_strided);
  m.impl("view", &standin::view);
  m.impl("_reshape_alias", &standin::reshape_alias);
  m.impl("resize_", &standin::resize_);
  m.impl("_copy_from", &standin::copy_from);
  m.impl("_copy_from_and_resize", &standin::copy_from_and_resize);
  m.impl("_local_scalar_dense", &standin::local_scalar_dense);
  m.impl("set_.source_Tensor", &standin::set_tensor);
  m.impl("set_.source_Storage", &standin::set_storage);
  m.impl("set_.source_Storage_storage_offset", &standin::set_storage_offset);
  m.impl("native_dropout", &standin::native_dropout);
  m.impl("_has_compatible_shallow_copy_type", &standin::has_compatible_shallow_copy_type);
  m.impl("_thnn_fused_lstm_cell", &standin::fused_lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", &standin::fused_lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", &standin::fused_gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", &standin::fused_gru_cell_backward);
  // their default (CompositeExplicitAutograd) kernels raise and would win over the fallback: route them to it
  m.impl("convolution_overrideable", torch::CppFunction::makeFromBoxedFunction<&standin::cpu_fallback>());
  m.impl("convolution_backward_overrideable", torch::CppFunction::makeFromBoxedFunction<&standin::cpu_fallback>());
}

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &standin::sdp_choice)
}  // namespace at::native

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&standin::cpu_fallback>());
}

// Copies resolve conjugate and negative views themselves (their host aliases carry the bits): PyTorch's math-bit
// fallbacks would first materialize the source with clone(), which copies through `_copy_from` again, forever.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

// Autocast: the same op lists as CUDA's (matmuls and convolutions in the lower precision, reductions, norms and
// losses in fp32), applied to the neuron device.
#define STANDIN_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define STANDIN_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define STANDIN_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define STANDIN_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

namespace at::autocast {  // the op-list macros name ATen types unqualified

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

// Refused under autocast, as on CUDA and TorchNeuron (its autocast registers the same ban and message).
Tensor binary_cross_entropy_banned(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  m.impl("binary_cross_entropy", TORCH_FN(binary_cross_entropy_banned));
  AT_FORALL_LOWER_PRECISION_FP(STANDIN_LOWER_PRECISION_FP)
  AT_FORALL_FP32(STANDIN_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(STANDIN_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(STANDIN_PROMOTE)
}

}  // namespace at::autocast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  standin::serve_cpu_kernels_over_composites();
  m.def("register_hooks", &standin::register_hooks, "Register the PrivateUse1 hooks (once, before first use).");
  m.def("set_device_count", &standin::set_device_count);
  m.def("device_count", [] { return standin::g_device_count.load(); });
  m.def("current_device", [] { return static_cast<int>(standin::t_current_device); });
  m.def("set_device", [](int d) {
    standin::check_index(static_cast<c10::DeviceIndex>(d));
    standin::t_current_device = static_cast<c10::DeviceIndex>(d);
  });
  m.def("default_generator", [](int d) { return standin::default_generator(static_cast<c10::DeviceIndex>(d)); });
  m.def("counters", &standin::counters);
  m.def("fallback_counts", &standin::fallback_counts);
  m.def("host_op_counts", &standin::host_op_counts);
  m.def("set_host_ops", &standin::set_host_ops);
  m.def("reset_counters", &standin::reset_counters);
  m.def("synchronize", &standin::on_host_sync, "Wait for the device (the stand-in never runs behind): a host sync.");
  m.def("set_strict", [](bool on) { return standin::g_strict.exchange(on); });
  m.def("runtime_initialized", [] { return standin::g_runtime_initialized.load(); },
        "Whether a device tensor was ever allocated in this process (TorchNeuron's runtime starts then).");
  m.def("in_bad_fork", [] { return standin::g_in_bad_fork.load(); });
  standin::bind_distributed(m);
}
