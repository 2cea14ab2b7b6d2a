// CPU stand-in for TorchNeuron's native `neuron` device (PyTorch PrivateUse1, renamed to "neuron" from Python).
//
// Device memory is host memory. A handful of kernels are native to the device (creation, views, copies, scalar
// reads, dropout); every other op runs on the CPU through a boxed fallback that first checks that the op does not
// mix devices, as a real accelerator would refuse to (ops whose schema hides what they do go through a twin op that
// says it: `twin_of`). Counters record device->host copies, scalar reads and the ops
// the fallback served, by name, and host syncs: the waits for the device that an asynchronous device would have
// (blocking copies to the host, scalar reads, synchronize calls; a `non_blocking` copy into pinned memory is a
// transfer but no wait). Ops named in set_host_ops() act as the real device's CPU-fallback ops (their copies count
// as transfers); strict mode raises on any device->host read. Written against PyTorch 2.13.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
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
std::atomic<int64_t> g_scalar_reads{0};
std::atomic<int64_t> g_host_syncs{0};
std::atomic<bool> g_strict{false};
std::mutex g_fallback_mutex;
std::map<std::string, int64_t> g_fallback_counts;
// Ops (by name, any overload) the stand-in treats as missing on the device, like TorchNeuron's CPU fallback ops:
// their copies are counted as transfers, and each call is counted here by full name.
std::set<std::string> g_host_ops;
std::map<std::string, int64_t> g_host_op_counts;
// True while the CPU fallback moves an op's arguments and results: those copies are the stand-in's own
// plumbing (a real device runs the op where the data is), so they are neither counted nor refused.
thread_local bool t_in_fallback = false;

void on_device_read(const char* what, const at::Tensor& tensor, std::atomic<int64_t>& counter) {
  if (t_in_fallback) return;
  TORCH_CHECK(
      !g_strict.load(), "lightning_trn.standin strict mode: a device->host read (", what, " of a ",
      tensor.sizes(), " ", tensor.scalar_type(), " tensor on ", tensor.device(),
      ") happened inside lightning_trn.standin.strict(). On a real Neuron device it would stall the host "
      "until the device catches up; move the read out of the step or to a logging point.");
  counter++;
}

// The host waits for the device: what stalls an asynchronous device's host thread (not the fallback's plumbing).
void on_host_sync() {
  if (!t_in_fallback) g_host_syncs++;
}

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
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

void check_empty_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "neuron supports strided tensors only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU tensors can be pinned");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  check_empty_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<Device> device,
                         std::optional<bool> pin_memory) {
  check_empty_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
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
  if (self.is_cpu() && dst.is_privateuseone() && !t_in_fallback) g_host_to_device++;
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

// Ops whose schema hides what they do, served through a twin whose schema says it (same results on the CPU):
// - the `*_overrideable` convolutions are extension points without a CPU kernel: `convolution`(_backward) serve
//   them, as a backend with its own convolution kernels (TorchNeuron) does;
// - `native_batch_norm` updates running_mean/running_var in training without declaring them mutable, so the
//   fallback would not copy them back to the device: `_native_batch_norm_legit` declares them (Tensor(a!)).
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
  if (name == "aten::native_batch_norm") {  // (input, weight, bias, running_mean, running_var, training, ...)
    const bool mean = !stack[begin + 3].isNone(), var = !stack[begin + 4].isNone();
    if (mean && var) {
      static const auto legit = dispatcher.findSchemaOrThrow("aten::_native_batch_norm_legit", "");
      return &legit;
    }
    if (!mean && !var) {
      stack.erase(stack.begin() + begin + 3, stack.begin() + begin + 5);
      static const auto no_stats = dispatcher.findSchemaOrThrow("aten::_native_batch_norm_legit", "no_stats");
      return &no_stats;
    }
  }
  return nullptr;
}

struct InFallback {
  bool previous = t_in_fallback;
  InFallback() { t_in_fallback = true; }
  ~InFallback() { t_in_fallback = previous; }
};

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
  const c10::OperatorHandle& served = twin != nullptr ? *twin : op;
  if (host_op) {  // as the real device's CPU fallback: its argument and result copies are counted transfers
    at::native::cpu_fallback(served, stack);
    return;
  }
  InFallback guard;
  at::native::cpu_fallback(served, stack);
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
  // their default (CompositeExplicitAutograd) kernels raise and would win over the fallback: route them to it
  m.impl("convolution_overrideable", torch::CppFunction::makeFromBoxedFunction<&standin::cpu_fallback>());
  m.impl("convolution_backward_overrideable", torch::CppFunction::makeFromBoxedFunction<&standin::cpu_fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&standin::cpu_fallback>());
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
