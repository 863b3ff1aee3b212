// Plain multi-threaded read of byte ranges (the bandwidth bound the executor is measured against).
#pragma once

#include <cstdint>

namespace ft {

// Reads every byte of the `count` ranges with the pool's threads; returns an XOR checksum so the
// reads cannot be optimised away.
uint64_t read_ranges(const uintptr_t* ptrs, const int64_t* sizes, int64_t count);

}  // namespace ft
