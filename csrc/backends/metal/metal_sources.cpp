// Include inlining for the embedded .metal sources (metal_sources.h). Kept out of device_metal.mm so that
// CI compiles and tests it.
#include "metal_sources.h"

#include <set>
#include <sstream>
#include <stdexcept>

namespace lily::metal {

namespace {

const EmbeddedSource* find_source(const std::string& name) {
  for (int i = 0; i < kMetalSourceCount; ++i)
    if (name == kMetalSources[i].name) return &kMetalSources[i];
  return nullptr;
}

// The quoted file of `#include "x"` (spaces allowed around '#'), or "" when the line is anything else.
std::string quoted_include(const std::string& line) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string::npos || line[i] != '#') return "";
  i = line.find_first_not_of(" \t", i + 1);
  if (i == std::string::npos || line.compare(i, 7, "include") != 0) return "";
  i = line.find_first_not_of(" \t", i + 7);
  if (i == std::string::npos || line[i] != '"') return "";
  const size_t end = line.find('"', i + 1);
  return end == std::string::npos ? "" : line.substr(i + 1, end - i - 1);
}

void inline_into(std::ostringstream& out, const std::string& name, std::set<std::string>& once, int depth) {
  const EmbeddedSource* src = find_source(name);
  if (!src) throw std::runtime_error("[metal] '" + name + "' is not an embedded metal/ source");
  if (depth > 16) throw std::runtime_error("[metal] include depth above 16 at '" + name + "'");
  const std::string text = src->text;
  if (text.find("#pragma once") != std::string::npos) {
    if (!once.insert(name).second) return;
  }
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  out << "#line 1 \"" << name << "\"\n";
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find("#pragma once") != std::string::npos && line.find_first_not_of(" \t") == line.find('#')) {
      out << '\n';  // handled above; in a single unit it would only draw a warning
      continue;
    }
    const std::string inc = quoted_include(line);
    if (inc.empty()) {
      out << line << '\n';
      continue;
    }
    inline_into(out, inc, once, depth + 1);
    out << "#line " << lineno + 1 << " \"" << name << "\"\n";
  }
}

}  // namespace

std::vector<std::string> metal_source_files() {
  std::vector<std::string> files;
  for (int i = 0; i < kMetalSourceCount; ++i) {
    const std::string n = kMetalSources[i].name;
    if (n.size() > 6 && n.compare(n.size() - 6, 6, ".metal") == 0) files.push_back(n);
  }
  return files;  // the generator sorts them
}

std::string metal_translation_unit(const std::string& file) {
  std::ostringstream out;
  std::set<std::string> once;
  inline_into(out, file, once, 0);
  return out.str();
}

}  // namespace lily::metal
