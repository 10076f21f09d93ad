// "[2, 3, 64]": a shape as the ops' error messages print it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

inline std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace kiln
