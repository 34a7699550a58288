// torch's CPU tensors from plain malloc, aligned by hand (miles/backends/torch/allocator.py).
//
// torch's default CPU allocator asks glibc for 64-byte-aligned blocks (posix_memalign).
// glibc serves such a request of n bytes from a free block of n + 64 + 32 or more, then
// trims it to n, so a block freed by a tensor never fits the next tensor of the same size:
// in a train step every activation and temporary grows the heap instead of reusing the
// holes its predecessors left. Here a tensor of n bytes is one malloc of n + 64 + 8 bytes
// (the data starts at the first 64-byte boundary after a slot that holds malloc's
// pointer), so a freed block fits the next tensor of its size exactly.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <cstdlib>
#include <new>

namespace {

constexpr std::size_t kAlignment = 64;  // what torch's own CPU allocator gives (AVX-512 loads)

void free_aligned(void* data) {
  if (data != nullptr) {
    std::free(static_cast<void**>(data)[-1]);
  }
}

class HeapCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    void* data = nullptr;
    if (nbytes != 0) {
      void* block = std::malloc(nbytes + kAlignment + sizeof(void*));
      if (block == nullptr) {
        throw std::bad_alloc();
      }
      auto start = reinterpret_cast<std::uintptr_t>(block) + sizeof(void*);
      data = reinterpret_cast<void*>((start + kAlignment - 1) & ~(kAlignment - 1));
      static_cast<void**>(data)[-1] = block;
    }
    return {data, data, &free_aligned, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_aligned; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HeapCPUAllocator heap_cpu_allocator;

}  // namespace

// Installs the allocator for every later CPU tensor (tensors already allocated keep their
// own deleter). Returns 1 when torch now hands out CPU memory from it.
extern "C" int miles_use_heap_cpu_allocator() {
  c10::SetCPUAllocator(&heap_cpu_allocator, /*priority=*/1);
  return c10::GetCPUAllocator() == &heap_cpu_allocator ? 1 : 0;
}
