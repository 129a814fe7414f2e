// The docs stay true: every link in README.md and docs/ resolves (a code link must name a
// `Note [...]` anchor comment in its file, so that it survives edits around it), every page of
// docs/ddp/ ends with questions whose answers name a test that exists, and the answers that
// no other test asserts are asserted here.
#include <dirent.h>
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/explain.h"
#include "dist/init.h"
#include "nn/autocast.h"
#include "nn/layers.h"
#include "tests/batches.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using testing::source_dir;

namespace {

// The default group of one rank over Gloo: the pages' single-process answers.
std::shared_ptr<dist::ProcessGroup> init_gloo_world_of_one() {
  dist::InitOptions options;
  options.backend = dist::Backend::Gloo;
  options.rank = 0;
  options.world_size = 1;
  options.init_method = "tcp://127.0.0.1:0";
  return dist::init_process_group(options);
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool is_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

// GitHub's anchor for a heading or a note: lower case, spaces to '-', other punctuation dropped.
std::string slug(const std::string& text) {
  std::string out;
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '-' || c == '_') out += static_cast<char>(std::tolower(u));
    else if (c == ' ') out += '-';
  }
  return out;
}

// The anchors a source file offers: "note-bucket-order" for a comment "Note [Bucket order]".
std::set<std::string> note_anchors(const std::string& text) {
  std::set<std::string> anchors;
  const std::regex note(R"(Note \[([^\]]+)\])");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), note); it != std::sregex_iterator(); ++it)
    anchors.insert("note-" + slug((*it)[1].str()));
  return anchors;
}

// A page's anchors: its headings' slugs and explicit <a id="..."> targets.
std::set<std::string> heading_anchors(const std::string& text) {
  std::set<std::string> anchors;
  const std::regex heading(R"((?:^|\n)#+ ([^\n]+))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), heading); it != std::sregex_iterator(); ++it)
    anchors.insert(slug((*it)[1].str()));
  const std::regex id(R"re(<a id="([^"]+)")re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), id); it != std::sregex_iterator(); ++it)
    anchors.insert((*it)[1].str());
  return anchors;
}

std::vector<std::string> markdown_pages() {
  const std::string root = source_dir();
  std::vector<std::string> pages = {"README.md"};
  for (const std::string folder : {"docs", "docs/ddp"}) {
    if (DIR* dir = ::opendir((root + "/" + folder).c_str())) {
      while (dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name.size() > 3 && name.compare(name.size() - 3, 3, ".md") == 0) pages.push_back(folder + "/" + name);
      }
      ::closedir(dir);
    }
  }
  return pages;
}

std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1);
}

// The series (docs/ddp/ and its index) links code only through Note anchors; other pages may
// link a whole file.
bool anchors_required(const std::string& page) {
  return page.rfind("docs/ddp/", 0) == 0 || page == "docs/how-ddp-works.md";
}

// Every problem with one page's links, one per line.
std::string dangling_links(const std::string& page) {
  const std::string root = source_dir();
  const std::string text = read(root + "/" + page);
  std::ostringstream problems;
  const std::regex link(R"(\]\(([^)\s]+)\))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), link); it != std::sregex_iterator(); ++it) {
    const std::string target = (*it)[1].str();
    if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0) continue;
    const size_t hash = target.find('#');
    const std::string file = target.substr(0, hash);
    const std::string anchor = hash == std::string::npos ? "" : target.substr(hash + 1);
    const std::string path = file.empty() ? root + "/" + page : root + "/" + folder_of(page) + file;
    const bool is_markdown = file.empty() || (file.size() > 3 && file.compare(file.size() - 3, 3, ".md") == 0);
    const bool is_folder = !file.empty() && file.back() == '/';
    if (is_folder) {
      if (!is_directory(path)) problems << page << ": link to " << target << ": no folder " << path << "\n";
      continue;
    }
    if (!is_file(path)) {
      problems << page << ": link to " << target << ": no file " << path << "\n";
      continue;
    }
    if (is_markdown) {
      if (!anchor.empty() && heading_anchors(read(path)).count(anchor) == 0)
        problems << page << ": link to " << target << ": no heading with that anchor\n";
    } else if (anchor.empty()) {
      if (!anchors_required(page)) continue;
      problems << page << ": link to " << target << ": a code link must name a Note anchor (file#note-...)\n";
    } else if (note_anchors(read(path)).count(anchor) == 0) {
      problems << page << ": link to " << target << ": no \"Note [...]\" comment with that anchor in " << file
               << "\n";
    }
  }
  return problems.str();
}

// The files whose text names other files: sources, scripts and docs, not build output.
std::vector<std::string> repository_files(const std::string& folder = "") {
  std::vector<std::string> files;
  const std::string root = source_dir();
  DIR* dir = ::opendir((root + "/" + folder).c_str());
  if (dir == nullptr) return files;
  static const std::regex text_file(R"(.*\.(h|cpp|cu|cuh|inc|md|py|sh)|meson\.build)");
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name[0] == '.' || name.rfind("build", 0) == 0 || name == "subprojects") continue;
    const std::string path = folder.empty() ? name : folder + "/" + name;
    struct stat link {};
    if (::lstat((root + "/" + path).c_str(), &link) != 0 || S_ISLNK(link.st_mode)) continue;  // include/nanoddp/
    if (is_directory(root + "/" + path)) {
      for (std::string& inner : repository_files(path)) files.push_back(std::move(inner));
    } else if (std::regex_match(name, text_file) || folder.rfind("tools", 0) == 0) {
      files.push_back(path);
    }
  }
  ::closedir(dir);
  std::sort(files.begin(), files.end());
  return files;
}

int series_pages() {
  int pages = 0;
  for (const std::string& page : markdown_pages()) pages += page.rfind("docs/ddp/", 0) == 0 ? 1 : 0;
  return pages;
}

// Every stale cross-reference in one file, one per line:
//   - a path from the repository's root (dist/reducer.cpp, DESIGN.md) that names no file; a
//     name in capitals inside a folder (tests/FILE.cpp) is a placeholder;
//   - in a page of docs, a link "[page N](...)" whose target is not docs/ddp/NN-*.md, and a
//     "page N" that is no link (outside the series, where a bare number cannot be checked)
//     or names no page of the series.
std::string stale_references(const std::string& file) {
  const std::string root = source_dir();
  const std::string text = read(root + "/" + file);
  std::ostringstream problems;
  static const std::regex path(
      R"((?:^|[^A-Za-z0-9_./-])((?:core|dist|nn|kernels|tests|examples|benchmarks|tools|docs|data|include)/)"
      R"([A-Za-z0-9_./-]*[A-Za-z0-9_]\.(?:h|cpp|cuh|cu|inc|md|py|sh|json)|[A-Z][A-Z_]*\.md)\b)");
  static const std::regex placeholder(R"(.*/[A-Z_]+\.[a-z]+)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), path); it != std::sregex_iterator(); ++it) {
    const std::string named = (*it)[1].str();
    if (!std::regex_match(named, placeholder) && !is_file(root + "/" + named))
      problems << file << ": names " << named << ", which does not exist\n";
  }
  if (file.size() < 3 || file.compare(file.size() - 3, 3, ".md") != 0) return problems.str();
  const bool in_series = file.rfind("docs/ddp/", 0) == 0 || file == "docs/how-ddp-works.md";
  const int pages = series_pages();
  static const std::regex page(R"((\[)?\bpages? (\d+)([^\]\n]*\]\(([^)\s]*)\))?)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), page); it != std::sregex_iterator(); ++it) {
    const int number = std::stoi((*it)[2].str());
    const bool linked = (*it)[1].matched && (*it)[3].matched;
    if (linked) {
      const std::string target = (*it)[4].str();
      const std::string name = target.substr(target.rfind('/') == std::string::npos ? 0 : target.rfind('/') + 1);
      char prefix[8];
      std::snprintf(prefix, sizeof prefix, "%02d-", number);
      if (name.rfind(prefix, 0) != 0)
        problems << file << ": \"" << (*it)[0].str() << "\" links a page other than page " << number << "\n";
    } else if (!in_series) {
      problems << file << ": \"page " << number << "\" is no link; write [page " << number << "](ddp/...)\n";
    } else if (number < 1 || number > pages) {
      problems << file << ": \"page " << number << "\": the series has pages 1 to " << pages << "\n";
    }
  }
  return problems.str();
}

}  // namespace

TEST_CASE("docs: every link resolves, and every code link names a Note anchor in its file") {
  const auto pages = markdown_pages();
  REQUIRE(pages.size() >= 12);  // README, how-ddp-works, adding-a-layer and the series
  std::string problems;
  for (const std::string& page : pages) problems += dangling_links(page);
  CHECK_MESSAGE(problems.empty(), problems);
}

TEST_CASE("docs: the link checker catches a dangling file, a missing anchor and an anchorless code link") {
  const std::string notes = "// Note [Bucket order]\n// Note [Gloo worker thread]\n";
  CHECK(note_anchors(notes) == std::set<std::string>{"note-bucket-order", "note-gloo-worker-thread"});
  CHECK(heading_anchors("# How DDP works\n## 3. A process group: the collectives\n<a id=\"who-may-join\"></a>\n") ==
        std::set<std::string>{"how-ddp-works", "3-a-process-group-the-collectives", "who-may-join"});
  testing::TempDir dir;
  ::mkdir((dir.path + "/docs").c_str(), 0700);
  ::mkdir((dir.path + "/docs/ddp").c_str(), 0700);
  std::ofstream(dir.path + "/code.cpp") << "// Note [Real one]\nint x;\n";
  std::ofstream(dir.path + "/docs/ddp/page.md") << "[a](../../code.cpp#note-real-one) [b](../../missing.cpp#note-x) "
                                                   "[c](../../code.cpp#note-not-there) [d](../../code.cpp) [e](#nowhere) "
                                                   "[f](../) [g](../../gone/)\n";
  const std::string saved = source_dir();
  ::setenv("NANODDP_SOURCE_DIR", dir.path.c_str(), 1);
  const std::string problems = dangling_links("docs/ddp/page.md");
  ::setenv("NANODDP_SOURCE_DIR", saved.c_str(), 1);
  CHECK(problems.find("note-real-one") == std::string::npos);
  CHECK(problems.find("link to ../../missing.cpp#note-x: no file") != std::string::npos);
  CHECK(problems.find("link to ../../code.cpp#note-not-there: no \"Note") != std::string::npos);
  CHECK(problems.find("link to ../../code.cpp: a code link must name a Note anchor") != std::string::npos);
  CHECK(problems.find("link to #nowhere: no heading") != std::string::npos);
  CHECK(problems.find("link to ../: no folder") == std::string::npos);
  CHECK(problems.find("link to ../../gone/: no folder") != std::string::npos);
}

TEST_CASE("docs and comments: every file path names a file, every \"page N\" names page N of the series") {
  const std::vector<std::string> files = repository_files();
  REQUIRE(files.size() >= 100);
  std::string problems;
  for (const std::string& file : files)
    if (file != "tests/test_docs.cpp") problems += stale_references(file);  // its fixtures name no files
  CHECK_MESSAGE(problems.empty(), problems);
}

TEST_CASE("docs: the cross-reference checker catches a missing file, a wrong page and an unchecked page number") {
  testing::TempDir dir;
  for (const char* folder : {"/docs", "/docs/ddp", "/dist", "/build"}) ::mkdir((dir.path + folder).c_str(), 0700);
  std::ofstream(dir.path + "/docs/ddp/01-launch.md") << "# 1\n";
  std::ofstream(dir.path + "/docs/ddp/02-sharding.md") << "Back to page 1, on to page 3 (there is none).\n";
  std::ofstream(dir.path + "/dist/code.cpp") << "// As dist/code.cpp and DESIGN.md say; see tests/FILE.cpp.\n";
  std::ofstream(dir.path + "/build/generated.h") << "// dist/not_checked.h\n";
  std::ofstream(dir.path + "/docs/hooks.md") << "See [page 1](ddp/01-launch.md), [page 2](ddp/01-launch.md) and "
                                               "page 2, and ../dist/code.cpp.\n";
  const std::string saved = source_dir();
  ::setenv("NANODDP_SOURCE_DIR", dir.path.c_str(), 1);
  std::string problems;
  const std::vector<std::string> files = repository_files();
  for (const std::string& file : files) problems += stale_references(file);
  ::setenv("NANODDP_SOURCE_DIR", saved.c_str(), 1);
  CHECK(files.size() == 4);  // not build/
  CHECK(problems ==
        "dist/code.cpp: names DESIGN.md, which does not exist\n"
        "docs/ddp/02-sharding.md: \"page 3\": the series has pages 1 to 2\n"
        "docs/hooks.md: \"[page 2](ddp/01-launch.md)\" links a page other than page 2\n"
        "docs/hooks.md: \"page 2\" is no link; write [page 2](ddp/...)\n");
}

TEST_CASE("docs: every page of the series ends with questions whose answers name an existing test") {
  const std::string root = source_dir();
  int pages = 0;
  for (const std::string& page : markdown_pages()) {
    // The ladder's and checkpointing's pages ask the same way (what to predict, then a test
    // says what comes back).
    const bool in_series = page.rfind("docs/ddp/", 0) == 0;
    if (!in_series && page != "docs/ladder.md" && page != "docs/checkpointing.md" &&
        page != "docs/mixed-precision.md")
      continue;
    if (in_series) ++pages;
    CAPTURE(page);
    const std::string text = read(root + "/" + page);
    const size_t check = text.find("## Check yourself");
    REQUIRE_MESSAGE(check != std::string::npos, page, " has no \"## Check yourself\" section");
    // Each answer: Asserted by `tests/FILE.cpp`, "TEST CASE NAME".
    const std::string questions = text.substr(check);
    const std::regex asserted(R"re(Asserted by\s+`(tests/[a-z_]+\.cpp)`,\s+"([^"]+)")re");
    int answers = 0;
    for (auto it = std::sregex_iterator(questions.begin(), questions.end(), asserted); it != std::sregex_iterator();
         ++it) {
      ++answers;
      const std::string file = (*it)[1].str(), test = (*it)[2].str();
      const std::string source = read(root + "/" + file);
      // The name, then ")" or a decorator (" * doctest::skip(...)").
      const bool found = source.find("TEST_CASE(\"" + test + "\")") != std::string::npos ||
                         source.find("TEST_CASE(\"" + test + "\" *") != std::string::npos;
      CHECK_MESSAGE(found, page, ": no test \"", test, "\" in ", file);
    }
    CHECK_MESSAGE(answers >= 1, page, ": no answer names the test that asserts it");
  }
  CHECK(pages == 12);
}

// docs/ddp/04-hooks-and-buckets.md and 05-all-reduce-algorithms.md.
TEST_CASE("docs answers: the default MLP is one bucket of 940584 bytes; a ring sends 2(N-1)/N of it per rank") {
  auto pg = init_gloo_world_of_one();
  auto model = testing::make_fashion_mnist_mlp();  // fashion_mnist's default
  dist::DistributedDataParallel ddp(model, pg);
  const auto plan = ddp.reducer().bucket_plan();
  REQUIRE(plan.size() == 1);
  int64_t bytes = 0;
  for (const Tensor& p : model->parameters()) bytes += static_cast<int64_t>(p.nbytes());
  CHECK(bytes == 940584);  // under the first bucket's 1 MiB cap (1048576 bytes)
  CHECK(dist::explain_plan(ddp).find("explain: bucket 0: 940584 bytes, 6 parameters: 4.bias [10], 4.weight [10, 128]") !=
        std::string::npos);
  CHECK(dist::explain_plan(ddp).find("world size 1: gradients are already the mean; no bucket is all-reduced") !=
        std::string::npos);
  // At world size 1 a compression hook still rounds every bucket, so the plan does not say "nothing happens".
  ddp.register_comm_hook(pg, dist::bf16_compress_hook);
  CHECK(dist::explain_plan(ddp).find("world size 1: gradients are already the mean, but the comm hook still runs") !=
        std::string::npos);
  dist::destroy_process_group();

  // NANODDP_EXPLAIN is a yes/no like the other NANODDP_* switches: "false" means no.
  // (a pair, not a structured binding: clang refuses one inside doctest's CHECK_MESSAGE)
  for (const std::pair<const char*, bool>& value : std::vector<std::pair<const char*, bool>>{
           {"", false}, {"0", false}, {"false", false}, {"Off", false}, {"1", true}, {"yes", true}}) {
    ::setenv("NANODDP_EXPLAIN", value.first, 1);
    CHECK_MESSAGE(dist::explain_from_environment() == value.second, "NANODDP_EXPLAIN='", value.first, "'");
  }
  ::setenv("NANODDP_EXPLAIN", "maybe", 1);
  CHECK_THROWS_WITH_AS(dist::explain_from_environment(),
                       doctest::Contains("NANODDP_EXPLAIN='maybe' is neither 1"), ValueError);
  ::unsetenv("NANODDP_EXPLAIN");

  CHECK(dist::ring_bytes_sent_per_rank(940584, 1) == 0);
  CHECK(dist::ring_bytes_sent_per_rank(940584, 2) == 940584);
  CHECK(dist::ring_bytes_sent_per_rank(940584, 4) == 1410876);  // 2 * 3 / 4 * 940584
  CHECK(dist::ring_bytes_sent_per_rank(940584, 8) == 1646022);  // 2 * 7 / 8 * 940584
}

// docs/mixed-precision.md, questions 1 and 2.
TEST_CASE("docs answers: bf16 reduce_dtype sends 470292 bytes per step; a bf16 Linear(784, 256) output at batch 64 is 32768") {
  auto pg = init_gloo_world_of_one();
  auto model = testing::make_fashion_mnist_mlp();  // fashion_mnist's default
  dist::DDPOptions ddp_options;
  ddp_options.reduce_dtype = DType::BFloat16;
  dist::DistributedDataParallel ddp(model, pg, ddp_options);
  const Tensor x = Tensor::ones({2, 784});
  const Tensor y = Tensor::from_vector(std::vector<int64_t>{1, 2});
  pg->reset_counts();
  Tensor logits;
  {
    nn::autocast guard(DType::BFloat16);
    logits = ddp(x);
  }
  CHECK(logits.dtype() == DType::BFloat16);
  // Question 2: a Linear(784, 256) output at batch 64 under autocast: 64 x 256 x 2 bytes.
  Generator gen(0);
  nn::Linear first(784, 256, gen);
  Tensor hidden;
  {
    nn::autocast guard(DType::BFloat16);
    hidden = first(Tensor::ones({64, 784}));
  }
  CHECK(hidden.dtype() == DType::BFloat16);
  CHECK(hidden.nbytes() == 32768);  // float32: 65536
  CHECK(first.weight.dtype() == DType::Float32);
  cross_entropy(logits, y).backward();
  // Question 1: 235146 gradients, 2 bytes each, in the one bucket (a comm hook runs at world 1).
  const dist::CollectiveCount count = pg->count(dist::Collective::AllReduce);
  CHECK(count.calls == 1);
  CHECK(count.bytes == 470292);
  for (const Tensor& p : model->parameters()) CHECK(p.grad().dtype() == DType::Float32);
  dist::destroy_process_group();
}
