// The standard headers most of the library's sources include, parsed once per build instead
// of once per source: they are ~98% of what the compiler reads for a typical source file
// (dist/ddp.cpp: 64,422 of 65,566 lines). Only standard headers belong here, so that an edit
// of one of ours still rebuilds only the sources that include it. Each source still includes
// what it uses: `-Db_pch=false` builds without this file.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>
