// Native CPU kernels for an attention term read from small tables by index, and batched products of small matrices
// (vispe.encodings.native).
//
// A term is a sum of parts. A part reads x[b * sxb + h * sxh + row * sxr + id] for the pair (query r, key j), with row
// the query (or, for a key-side read, the key) and id either
//   * given: idx[b?, r, j] (int32, e.g. iRPE's bucket of the pair), or
//   * an offset id: code_q[b?, r] - code_k[b?, j] + center, or `fill` when either code is negative (prefix tokens),
//     optionally mapped through a lookup table (iRPE's bucket of an offset): the lattice terms. Keys with consecutive
//     codes (a lattice row) have consecutive offset ids, so a row is a few reversed contiguous runs: no index array;
//     without a lookup, vector loads and conflict-free vector adds. Through a lookup whose offset ids come in rows
//     (one per offset along the other axes; `span` offsets along the last), equal rows are one pattern (iRPE's
//     product buckets: one per row bucket), so a query row first reads each pattern's `span` entries into a template,
//     then every run reads a template as it would read the table (backward: adds into the templates, then one sum
//     per segment of equal ids). Otherwise each key reads its id.
// gather_term builds a block's term (the forward's mask); term_attention_forward / term_attention_backward run the
// attention of a block of query rows in tiles of one (sample, head), the logits and their gradient staying in cache
// between the products and the term's passes. q, out and the gradients are read and written where they lie; k and v,
// which every tile's products read in full, are copied once per (sample, head) when their rows are strided (views of
// the qkv projection), so the tiles do not walk a page per key row.
// Only the headers the kernels use: <torch/extension.h> (the whole ATen API and pybind11) alone took ~60 s to
// compile on a 2-core CPU, these ~9 s. The functions are registered as operators (TORCH_LIBRARY) and reached from
// Python as torch.ops.vispe_native.* (~4.5 us a call), so no Python binding headers are needed either.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// exp(x) for float32, written so compilers vectorise it: 2^n p(r) with n = round(x / ln 2), |r| <= ln2 / 2 (Cody-Waite
// split of ln 2) and Cephes' polynomial; relative error ~1e-7. x is clamped to [-87, 88] (exp(-87) ~ 1.6e-38).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: the float's low bits hold round(x / ln 2)
  const float n = t - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t ni = __builtin_bit_cast(int32_t, t) - 0x4B400000;
  return p * __builtin_bit_cast(float, (ni + 127) << 23);
}

// keys [j0, j0 + len) with codes c0, c0 + 1, ... (c0 < 0: prefix keys, which read `fill`)
struct Run {
  int64_t j0, len;
  int32_t c0;
};

// entries [start, start + len) of the patterns, one id
struct Segment {
  int64_t start, len;
  int32_t id;
};

// sum of o[0, n), in 16 lanes past a few elements (vectorised without reassociating compiler flags)
inline float segment_sum(const float* __restrict o, int64_t n) {
  float s = 0.0f;
  int64_t t = 0;
  if (n >= 16) {
    float lanes[16] = {0};
    for (; t + 16 <= n; t += 16)
      for (int c = 0; c < 16; ++c) lanes[c] += o[t + c];
    for (int c = 0; c < 16; ++c) s += lanes[c];
  }
  for (; t < n; ++t) s += o[t];
  return s;
}

// g[ids[j]] += o[j], j < L, in key order: neighbouring keys often share an id (iRPE's buckets), so equal neighbours
// are summed in a register first instead of each waiting on the previous add's store
inline void add_ids(float* g, const int32_t* ids, const float* o, int64_t L) {
  if (L == 0) return;
  int32_t prev = ids[0];
  float acc = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    const int32_t id = ids[j];
    if (id != prev) { g[prev] += acc; acc = 0.0f; prev = id; }
    acc += o[j];
  }
  g[prev] += acc;
}

struct Part {
  const float* x;
  int64_t sxb, sxh, sxr;
  float* g;  // nullptr: no gradient wanted
  int64_t sgb, sgh, sgr;
  bool key_rows;
  const int32_t* idx;  // given ids (B|1, R, L), or nullptr: offset ids from codes
  int64_t sib;
  const int32_t* cq;  // query codes of the block's rows (B|1, R)
  int64_t scq;
  std::vector<std::vector<Run>> runs;  // per code sample: the key runs
  const int32_t* lut;  // optional: the id is lut[offset id] (iRPE's bucket of an offset)
  // templates (a lookup in rows of `span` whose distinct rows, the patterns, are small against a row of keys):
  // offset id u reads pattern row_class[u / span] at u % span
  int64_t span = 0;
  std::vector<int32_t> row_class, patterns;
  std::vector<Segment> segments;  // of equal ids within each pattern
  int64_t center, fill;

  int64_t scratch() const { return span ? static_cast<int64_t>(patterns.size()) : 0; }

  // a run of keys t = 0, 1, ... at offset ids u0 - t: f(t, n, entry) per stretch of n keys within one lookup row,
  // whose template entries are entry, entry - 1, ...
  template <class F>
  void for_rows(int64_t u0, int64_t len, F&& f) const {
    for (int64_t t = 0; t < len;) {
      const int64_t u = u0 - t, row = u / span, col = u - row * span;
      const int64_t n = std::min(len - t, col + 1);
      f(t, n, row_class[row] * span + col);
      t += n;
    }
  }

  // the part is shared by the batch: its gradient may take the batch's sum
  bool batch_shared(int64_t B) const { return B > 1 && sgb == 0 && sib == 0 && scq == 0 && runs.size() <= 1; }

  // o[j] += x[.., id(r, j)] for one row of logits of sample b, head h; `row` the block row r, `row_abs` its query index
  // `scratch`: scratch() floats of the calling thread
  void add_row(float* __restrict o, int64_t b, int64_t h, int64_t r, int64_t row_abs, int64_t L, float* scratch) const {
    const float* xb = x + b * sxb + h * sxh;
    if (idx) {
      const int32_t* __restrict ir = idx + b * sib + r * L;
      if (!key_rows) {
        const float* __restrict xr = xb + row_abs * sxr;
        for (int64_t j = 0; j < L; ++j) o[j] += xr[ir[j]];
      } else {
        for (int64_t j = 0; j < L; ++j) o[j] += xb[j * sxr + ir[j]];
      }
      return;
    }
    const float* __restrict xr = xb + row_abs * sxr;
    const int32_t ci = cq[b * scq + r];
    const auto& rs = runs[runs.size() > 1 ? b : 0];
    const int64_t fill_id = lut ? lut[fill] : fill;
    if (ci < 0) {
      const float z = xr[fill_id];
      for (int64_t j = 0; j < L; ++j) o[j] += z;
      return;
    }
    if (span)  // the row's templates: one table read per segment of equal ids
      for (const Segment& seg : segments) {
        const float z = xr[seg.id];
        float* __restrict d = scratch + seg.start;
        for (int64_t t = 0; t < seg.len; ++t) d[t] = z;
      }
    for (const Run& run : rs) {
      float* __restrict oj = o + run.j0;
      if (run.c0 < 0) {
        const float z = xr[fill_id];
        for (int64_t t = 0; t < run.len; ++t) oj[t] += z;
      } else if (span) {
        for_rows(ci + center - run.c0, run.len, [&](int64_t t, int64_t n, int64_t entry) {
          const float* __restrict src = scratch + entry;
          float* __restrict d = oj + t;
          for (int64_t s = 0; s < n; ++s) d[s] += src[-s];
        });
      } else if (lut) {
        const int32_t* __restrict ids = lut + (ci + center - run.c0);  // the run's ids, read downwards
        for (int64_t t = 0; t < run.len; ++t) oj[t] += xr[ids[-t]];
      } else {
        const float* __restrict src = xr + (ci + center - run.c0);  // entry of the run's first key; then downwards
        for (int64_t t = 0; t < run.len; ++t) oj[t] += src[-t];
      }
    }
  }

  // g[.., id(r, j)] += o[j]
  void scatter_row(const float* __restrict o, int64_t b, int64_t h, int64_t r, int64_t row_abs, int64_t L, float* scratch) const {
    float* gb = g + b * sgb + h * sgh;
    if (idx) {  // sequential adds: several keys of a row can share an entry
      const int32_t* ir = idx + b * sib + r * L;
      if (!key_rows) {
        add_ids(gb + row_abs * sgr, ir, o, L);
      } else {
        for (int64_t j = 0; j < L; ++j) gb[j * sgr + ir[j]] += o[j];
      }
      return;
    }
    float* gr = gb + row_abs * sgr;
    const int32_t ci = cq[b * scq + r];
    const auto& rs = runs[runs.size() > 1 ? b : 0];
    const int64_t fill_id = lut ? lut[fill] : fill;
    if (ci < 0) {
      float s = 0.0f;
      for (int64_t j = 0; j < L; ++j) s += o[j];
      gr[fill_id] += s;
      return;
    }
    if (span) std::fill(scratch, scratch + patterns.size(), 0.0f);
    for (const Run& run : rs) {
      const float* __restrict oj = o + run.j0;
      if (run.c0 < 0) {
        float s = 0.0f;
        for (int64_t t = 0; t < run.len; ++t) s += oj[t];
        gr[fill_id] += s;
      } else if (span) {  // a stretch's template entries are distinct: no conflicts
        for_rows(ci + center - run.c0, run.len, [&](int64_t t, int64_t n, int64_t entry) {
          float* dst = scratch + entry;
          const float* __restrict src = oj + t;
#pragma GCC ivdep
          for (int64_t s = 0; s < n; ++s) dst[-s] += src[s];
        });
      } else if (lut) {  // reversed: the run's ids in increasing key order are lut[base - t]
        const int32_t* ids = lut + (ci + center - run.c0);
        int32_t prev = ids[0];
        float acc = 0.0f;
        for (int64_t t = 0; t < run.len; ++t) {
          const int32_t id = ids[-t];
          if (id != prev) { gr[prev] += acc; acc = 0.0f; prev = id; }
          acc += oj[t];
        }
        gr[prev] += acc;
      } else {
        float* dst = gr + (ci + center - run.c0);  // a run's keys have distinct entries: no conflicts
#pragma GCC ivdep
        for (int64_t t = 0; t < run.len; ++t) dst[-t] += oj[t];
      }
    }
    if (span)
      for (const Segment& seg : segments) gr[seg.id] += segment_sum(scratch + seg.start, seg.len);
  }
};

std::vector<Run> key_runs(const int32_t* ck, int64_t L) {
  std::vector<Run> runs;
  int64_t j = 0;
  while (j < L) {
    int64_t e = j + 1;
    if (ck[j] < 0) {
      while (e < L && ck[e] < 0) ++e;
      runs.push_back({j, e - j, -1});
    } else {
      while (e < L && ck[e] == ck[e - 1] + 1) ++e;
      runs.push_back({j, e - j, ck[j]});
    }
    j = e;
  }
  return runs;
}

// Parts from Python: per part the table x, its gradient g (empty: none), the ids idx (empty: codes), query codes cq,
// key codes ck and a lookup table of offset ids (empty with ids; an empty lookup: the offset id itself), and 9 ints:
// sxb, sxh, sxr, sgb, sgh, sgr, key_rows, center, fill.
std::vector<Part> make_parts(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& gs,
                             const std::vector<at::Tensor>& idxs, const std::vector<at::Tensor>& cqs,
                             const std::vector<at::Tensor>& cks, const std::vector<at::Tensor>& luts,
                             const std::vector<int64_t>& ints, int64_t B, int64_t R, int64_t L) {
  const size_t n = xs.size();
  TORCH_CHECK(gs.size() == n && idxs.size() == n && cqs.size() == n && cks.size() == n && luts.size() == n &&
                  ints.size() == 10 * n,
              "term parts: one table, gradient, index, query codes, key codes and lookup table and 10 ints per part");
  std::vector<Part> parts(n);
  for (size_t p = 0; p < n; ++p) {
    Part& part = parts[p];
    const int64_t* o = ints.data() + 10 * p;
    TORCH_CHECK(xs[p].scalar_type() == at::kFloat, "term table: float32");
    part.x = xs[p].data_ptr<float>();
    part.sxb = o[0], part.sxh = o[1], part.sxr = o[2];
    const bool grad = gs[p].defined() && gs[p].numel() > 0;
    TORCH_CHECK(!grad || gs[p].scalar_type() == at::kFloat, "term gradient: float32");
    part.g = grad ? gs[p].data_ptr<float>() : nullptr;
    part.sgb = o[3], part.sgh = o[4], part.sgr = o[5];
    part.key_rows = o[6] != 0;
    part.center = o[7], part.fill = o[8];
    part.idx = nullptr, part.sib = 0, part.cq = nullptr, part.scq = 0, part.lut = nullptr;
    if (idxs[p].numel() > 0) {
      const auto& t = idxs[p];
      TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kInt && t.is_contiguous() && t.size(1) == R && t.size(2) == L &&
                  (t.size(0) == 1 || t.size(0) == B), "ids: contiguous int32 (B|1, rows, L)");
      part.idx = t.data_ptr<int32_t>();
      part.sib = t.size(0) > 1 ? R * L : 0;
    } else {
      const auto &cq = cqs[p], &ck = cks[p];
      TORCH_CHECK(!part.key_rows, "offset ids from codes: query-row reads only");
      TORCH_CHECK(cq.dim() == 2 && cq.scalar_type() == at::kInt && cq.is_contiguous() && cq.size(1) == R &&
                  (cq.size(0) == 1 || cq.size(0) == B), "query codes: contiguous int32 (B|1, rows)");
      TORCH_CHECK(ck.dim() == 2 && ck.scalar_type() == at::kInt && ck.is_contiguous() && ck.size(1) == L &&
                  (ck.size(0) == 1 || ck.size(0) == B), "key codes: contiguous int32 (B|1, L)");
      part.cq = cq.data_ptr<int32_t>();
      part.scq = cq.size(0) > 1 ? R : 0;
      if (luts[p].numel() > 0) {
        TORCH_CHECK(luts[p].dim() == 1 && luts[p].scalar_type() == at::kInt && luts[p].is_contiguous() &&
                    luts[p].numel() > part.fill, "lookup table: contiguous int32 over every offset id");
        part.lut = luts[p].data_ptr<int32_t>();
        const int64_t span = o[9];
        TORCH_CHECK(span >= 0 && (span == 0 || part.fill % span == 0), "lookup rows: a span that divides the offset ids");
        if (span > 0) {
          const int64_t rows = part.fill / span;
          for (int64_t row = 0; row < rows; ++row) {
            const int32_t* ids = part.lut + row * span;
            int64_t k = 0;
            const int64_t K = static_cast<int64_t>(part.patterns.size()) / span;
            while (k < K && !std::equal(ids, ids + span, part.patterns.begin() + k * span)) ++k;
            if (k == K) part.patterns.insert(part.patterns.end(), ids, ids + span);
            part.row_class.push_back(static_cast<int32_t>(k));
          }
          // templates where their entries are at most 3/4 of a row of keys: measured on iRPE's product buckets, per-key
          // reads were ~10 % faster with 0.96 (197 keys), equal with 0.75 (325) and slower below
          if (4 * static_cast<int64_t>(part.patterns.size()) <= 3 * L) {
            part.span = span;
            for (int64_t e = 0; e < static_cast<int64_t>(part.patterns.size());) {
              int64_t f = e + 1;
              while (f < static_cast<int64_t>(part.patterns.size()) && f % span && part.patterns[f] == part.patterns[e]) ++f;
              part.segments.push_back({e, f - e, part.patterns[e]});
              e = f;
            }
          } else {
            part.row_class.clear(), part.patterns.clear();
          }
        }
      }
      for (int64_t b = 0; b < ck.size(0); ++b) part.runs.push_back(key_runs(ck.data_ptr<int32_t>() + b * L, L));
    }
  }
  return parts;
}

// The tiles' products. A tile's products are small (64 rows), so the dispatcher and the tensor views around at::mm cost
// a tenth of their time; where PyTorch's library exports the Fortran sgemm (MKL builds on x86) and it passes a check
// it is called directly, else addmm_ on views of the same memory (same BLAS).
using fortran_sgemm = void (*)(const char*, const char*, const void*, const void*, const void*, const float*,
                               const float*, const void*, const float*, const void*, const float*, float*, const void*);

// Fortran BLAS takes its integers by pointer, 32-bit (LP64) or 64-bit (ILP64) by build: a little-endian int64 whose
// value fits 31 bits reads the same either way, so the sizes are passed as int64.
void call_sgemm(fortran_sgemm f, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  f(ta ? "T" : "N", tb ? "T" : "N", &M, &N, &K, &alpha, A, &lda, B, &ldb, &beta, C, &ldc);
}

fortran_sgemm find_sgemm() {
  const uint16_t probe = 1;
  if (*reinterpret_cast<const uint8_t*>(&probe) != 1) return nullptr;  // big-endian: the int64 trick does not hold
  Dl_info info;  // the library that holds PyTorch's CPU BLAS calls
  if (!dladdr(reinterpret_cast<void*>(&at::native::cpublas::brgemm_release), &info) || !info.dli_fname) return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return nullptr;
  for (const char* name : {"sgemm_", "SGEMM"}) {
    auto f = reinterpret_cast<fortran_sgemm>(dlsym(lib, name));
    if (!f) continue;
    // one small product checked against a loop before the symbol is trusted (column-major 2 x 3 times 3 x 2)
    const float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {7, 8, 9, 10, 11, 12};
    float c[4] = {0, 0, 0, 0};
    call_sgemm(f, false, false, 2, 2, 3, 1.0f, a, 2, b, 3, 0.0f, c, 2);
    bool ok = true;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        float want = 0;
        for (int t = 0; t < 3; ++t) want += a[i + 2 * t] * b[t + 3 * j];
        ok &= c[i + 2 * j] == want;
      }
    if (ok) return f;
  }
  return nullptr;
}

std::atomic<bool> direct_blas{true};  // switched off by tests to check the at::mm path

// C (m x n, row stride ldc) = alpha A' B' (+ C if accumulate): A' = A (m x k) or, with ta, A^T for A (k x m); likewise B'
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda, const float* B,
          int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  static const fortran_sgemm sgemm = find_sgemm();
  if (sgemm && direct_blas.load(std::memory_order_relaxed)) {
    // row-major C = A' B' is column-major C^T = B'^T A'^T: the same call with the operands swapped
    call_sgemm(sgemm, tb, ta, n, m, k, alpha, B, ldb, A, lda, accumulate ? 1.0f : 0.0f, C, ldc);
    return;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto view = [&](const float* p, int64_t rows, int64_t cols, int64_t ld, bool t) {
    auto x = at::from_blob(const_cast<float*>(p), {t ? cols : rows, t ? rows : cols}, {ld, 1}, opts);
    return t ? x.t() : x;
  };
  auto c = at::from_blob(C, {m, n}, {ldc, 1}, opts);
  c.addmm_(view(A, m, k, lda, ta), view(B, k, n, ldb, tb), accumulate ? 1.0f : 0.0f, alpha);
}

// A (B, H, rows, cols) float32 tensor read (or written) in place: rows at a stride, columns contiguous. q, k and v are
// views of the qkv projection ((B, L, 3, H, D) in memory), so the products read them where they lie, no copies.
struct Rows {
  float* p;
  int64_t sb, sh, sl;
  Rows(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat && (t.stride(3) == 1 || t.size(3) == 1) &&
                    (t.size(2) == 1 || t.stride(2) >= t.size(3)),
                name, ": float32 (B, H, rows, D) with contiguous rows");
    p = t.data_ptr<float>(), sb = t.stride(0), sh = t.stride(1);
    sl = t.size(2) == 1 ? t.size(3) : t.stride(2);
  }
  float* at(int64_t b, int64_t h, int64_t row) const { return p + b * sb + h * sh + row * sl; }
};

std::atomic<bool> pack_keys{true};  // switched off to compare with reading k and v where they lie

// One (sample, head)'s keys or values (L rows of D) for the products of every tile: where they lie when their rows are
// contiguous, else copied once into `buf` (L x D). q, k and v are views of the qkv projection, whose rows sit 3 H D
// floats apart: every product over all L keys would otherwise walk L pages (and TLB entries) per tile.
// The backward keeps one copy per sample of a head (its tiles loop over the batch): at most this many floats (8 MiB a
// thread), else the keys are read in place.
constexpr int64_t kMaxKeyCopyFloats = int64_t(1) << 21;

const float* key_rows(const Rows& X, int64_t b, int64_t h, int64_t L, int64_t D, std::vector<float>& buf, int64_t& ld,
                      bool allowed = true) {
  ld = X.sl;
  if (!allowed || X.sl == D || L == 1 || !pack_keys.load(std::memory_order_relaxed)) return X.at(b, h, 0);
  if (static_cast<int64_t>(buf.size()) < L * D) buf.resize(L * D);
  for (int64_t j = 0; j < L; ++j) std::copy_n(X.at(b, h, j), D, buf.data() + j * D);
  ld = D;
  return buf.data();
}

// floats of scratch a thread needs for the parts' templates
int64_t scratch_size(const std::vector<Part>& parts) {
  int64_t n = 1;
  for (const Part& p : parts) n = std::max(n, p.scratch());
  return n;
}

}  // namespace

// out (B|1, H, rows, L) = the block's term, rows row0 .. row0 + rows of the sequence.
void gather_term(at::Tensor out, std::vector<at::Tensor> xs, std::vector<at::Tensor> idxs,
                 std::vector<at::Tensor> cqs, std::vector<at::Tensor> cks, std::vector<at::Tensor> luts,
                 std::vector<int64_t> ints, int64_t row0) {
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kFloat && out.is_contiguous(), "term block: contiguous float32");
  const int64_t B = out.size(0), H = out.size(1), R = out.size(2), L = out.size(3);
  std::vector<at::Tensor> gs(xs.size());
  const auto parts = make_parts(xs, gs, idxs, cqs, cks, luts, ints, B, R, L);
  float* O = out.data_ptr<float>();
  const int64_t scratch_n = scratch_size(parts);
  at::parallel_for(0, B * H * R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_n);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / (H * R), h = (n / R) % H, r = n % R;
      float* o = O + n * L;
      std::fill(o, o + L, 0.0f);
      for (const Part& part : parts) part.add_row(o, b, h, r, row0 + r, L, scratch.data());
    }
  });
}

// max and sum of a row in 16 lanes (vectorised without reassociating compiler flags)
inline float row_max(const float* o, int64_t L) {
  float lanes[16];
  for (int t = 0; t < 16; ++t) lanes[t] = -3.0e38f;
  int64_t j = 0;
  for (; j + 16 <= L; j += 16)
    for (int t = 0; t < 16; ++t) lanes[t] = std::max(lanes[t], o[j + t]);
  float m = -3.0e38f;
  for (int t = 0; t < 16; ++t) m = std::max(m, lanes[t]);
  for (; j < L; ++j) m = std::max(m, o[j]);
  return m;
}

// o = exp(o - m) in place; returns the sum
inline float exp_row_sum(float* __restrict o, float m, int64_t L) {
  float lanes[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= L; j += 16)
    for (int t = 0; t < 16; ++t) {
      const float e = exp_approx(o[j + t] - m);
      o[j + t] = e;
      lanes[t] += e;
    }
  float s = 0.0f;
  for (; j < L; ++j) {
    o[j] = exp_approx(o[j] - m);
    s += o[j];
  }
  for (int t = 0; t < 16; ++t) s += lanes[t];
  return s;
}

// The attention forward of query rows row0 .. row0 + R with the term, in tiles of `tile` rows of one (sample, head):
// out = softmax(s q k^T + term) v and each row's log-sum-exp, written at those rows of out (B, H, Lq, Dv; any row
// layout) and lse (B, H, Lq). q (B, H, Lq, D), k, v (B, H, L, D): read in place.
void term_attention_forward(at::Tensor q, at::Tensor k, at::Tensor v, std::vector<at::Tensor> xs,
                            std::vector<at::Tensor> idxs, std::vector<at::Tensor> cqs, std::vector<at::Tensor> cks,
                            std::vector<at::Tensor> luts, std::vector<int64_t> ints, at::Tensor out, at::Tensor lse,
                            int64_t row0, int64_t R, int64_t tile, double scale) {
  const Rows Q(q, "q"), K(k, "k"), V(v, "v"), O(out, "out");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.dim() == 3, "lse: contiguous float32 (B, H, Lq)");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), L = k.size(2), Dv = v.size(3);
  TORCH_CHECK(tile > 0 && row0 >= 0 && R >= 0 && row0 + R <= Lq, "rows row0 .. row0 + R of the queries, positive tiles");
  std::vector<at::Tensor> gs(xs.size());
  const auto parts = make_parts(xs, gs, idxs, cqs, cks, luts, ints, B, R, L);
  const int64_t scratch_n = scratch_size(parts);
  float* lsep = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> P(tile * L), inv(tile), scratch(scratch_n), kbuf, vbuf;
    float* Pp = P.data();
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t b = n / H, h = n % H;
      int64_t ldk, ldv;
      const float* kp = key_rows(K, b, h, L, D, kbuf, ldk);
      const float* vp = key_rows(V, b, h, L, Dv, vbuf, ldv);
      for (int64_t r0 = 0; r0 < R; r0 += tile) {
        const int64_t tr = std::min(tile, R - r0), row = row0 + r0;
        gemm(false, true, tr, L, D, scale, Q.at(b, h, row), Q.sl, kp, ldk, false, Pp, L);
        float* lse_p = lsep + n * Lq + row;
        for (int64_t r = 0; r < tr; ++r) {
          float* o = Pp + r * L;
          for (const Part& part : parts) part.add_row(o, b, h, r0 + r, row + r, L, scratch.data());
          const float m = row_max(o, L);
          const float sum = exp_row_sum(o, m, L);  // o = exp(logits - max)
          inv[r] = 1.0f / sum;
          lse_p[r] = m + std::log(sum);
        }
        float* op = O.at(b, h, row);
        gemm(false, false, tr, Dv, L, 1.0f, Pp, L, vp, ldv, false, op, O.sl);
        // normalise the (rows, Dv) output rather than the (rows, L) weights
        for (int64_t r = 0; r < tr; ++r)
          for (int64_t c = 0; c < Dv; ++c) op[r * O.sl + c] *= inv[r];
      }
    }
  });
}

// The attention backward of query rows row0 .. row0 + R with the term's gradient (added into the parts' gradients), in
// tiles of `tile` rows of one (sample, head):
//   P = exp(s q k^T + term - lse); dV += P^T dO; dS = P * (dO V^T - delta); dQ = s dS k; dK += s dS^T q; g += dS
// with delta = rowsum(dO * O). q, dout, out (B, H, Lq, .), k, v (B, H, L, .): read in place; lse (B, H, Lq); dq written
// at the rows, dk, dv added into (any row layout). A part shared by the batch gets the batch's dS summed first (one
// scatter instead of B).
void term_attention_backward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor dout,
                             at::Tensor lse, std::vector<at::Tensor> xs, std::vector<at::Tensor> gs,
                             std::vector<at::Tensor> idxs, std::vector<at::Tensor> cqs, std::vector<at::Tensor> cks,
                             std::vector<at::Tensor> luts, std::vector<int64_t> ints, at::Tensor dq, at::Tensor dk,
                             at::Tensor dv, int64_t row0, int64_t R, int64_t tile, double scale) {
  const Rows Q(q, "q"), K(k, "k"), V(v, "v"), O(out, "out"), DO(dout, "dout"), DQ(dq, "dq"), DK(dk, "dk"), DV(dv, "dv");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.dim() == 3, "lse: contiguous float32 (B, H, Lq)");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), L = k.size(2), Dv = v.size(3);
  TORCH_CHECK(tile > 0 && row0 >= 0 && R >= 0 && row0 + R <= Lq, "rows row0 .. row0 + R of the queries, positive tiles");
  const auto parts = make_parts(xs, gs, idxs, cqs, cks, luts, ints, B, R, L);
  bool serial = false, any_shared = false;  // a gradient shared by the heads: one task adds into it
  for (const Part& p : parts) {
    serial |= p.g && p.sgh == 0;
    any_shared |= p.g && p.batch_shared(B);
  }
  const int64_t scratch_n = scratch_size(parts);
  const float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, H, serial ? H : 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> P(tile * L), dP(tile * L), acc(any_shared ? tile * L : 0), scratch(scratch_n), delta(tile);
    std::vector<std::vector<float>> kbuf(B), vbuf(B);
    std::vector<const float*> kp(B), vp(B);
    std::vector<int64_t> ldk(B), ldv(B);
    float *Pp = P.data(), *dPp = dP.data(), *A = any_shared ? acc.data() : nullptr;
    const bool copy_keys = B * L * (D + Dv) <= kMaxKeyCopyFloats;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t b = 0; b < B; ++b) {
        kp[b] = key_rows(K, b, h, L, D, kbuf[b], ldk[b], copy_keys);
        vp[b] = key_rows(V, b, h, L, Dv, vbuf[b], ldv[b], copy_keys);
      }
      for (int64_t r0 = 0; r0 < R; r0 += tile) {
        const int64_t tr = std::min(tile, R - r0), row = row0 + r0;
        for (int64_t b = 0; b < B; ++b) {
          const float *q_t = Q.at(b, h, row), *do_t = DO.at(b, h, row);
          gemm(false, true, tr, L, D, sc, q_t, Q.sl, kp[b], ldk[b], false, Pp, L);
          const float* lse_p = lsep + (b * H + h) * Lq + row;
          for (int64_t r = 0; r < tr; ++r) {
            float* __restrict o = Pp + r * L;
            for (const Part& part : parts) part.add_row(o, b, h, r0 + r, row + r, L, scratch.data());
            const float e = lse_p[r];
            for (int64_t j = 0; j < L; ++j) o[j] = exp_approx(o[j] - e);
            const float *dor = do_t + r * DO.sl, *outr = O.at(b, h, row + r);
            float d = 0.0f;
            for (int64_t c = 0; c < Dv; ++c) d += dor[c] * outr[c];
            delta[r] = d;
          }
          gemm(true, false, L, Dv, tr, 1.0f, Pp, L, do_t, DO.sl, true, DV.at(b, h, 0), DV.sl);  // dV += P^T dO
          gemm(false, true, tr, L, Dv, 1.0f, do_t, DO.sl, vp[b], ldv[b], false, dPp, L);         // dP = dO V^T
          for (int64_t r = 0; r < tr; ++r) {
            float* __restrict o = Pp + r * L;
            const float* __restrict d = dPp + r * L;
            const float c = delta[r];
            for (int64_t j = 0; j < L; ++j) o[j] *= d[j] - c;
            if (A) {
              float* __restrict a = A + r * L;
              if (b == 0) { for (int64_t j = 0; j < L; ++j) a[j] = o[j]; }
              else { for (int64_t j = 0; j < L; ++j) a[j] += o[j]; }
            }
            for (const Part& part : parts)
              if (part.g && !part.batch_shared(B)) part.scatter_row(o, b, h, r0 + r, row + r, L, scratch.data());
          }
          gemm(false, false, tr, D, L, sc, Pp, L, kp[b], ldk[b], false, DQ.at(b, h, row), DQ.sl);        // dQ = s dS k
          gemm(true, false, L, D, tr, sc, Pp, L, q_t, Q.sl, true, DK.at(b, h, 0), DK.sl);               // dK += s dS^T q
        }
        if (A) {
          for (int64_t r = 0; r < tr; ++r)
            for (const Part& part : parts)
              if (part.g && part.batch_shared(B)) part.scatter_row(A + r * L, 0, h, r0 + r, row + r, L, scratch.data());
        }
      }
    }
  });
}

// out[n] (+)= a[n] @ b[n] for a batch of small products with 8 result columns (LieRE's 8 x 8 blocks): a (N, M, K) with
// any strides, b (N, K, 8) with contiguous rows, out (N, M, 8) contiguous. ATen's bmm pays a BLAS call per product
// (or a scalar loop); here every output row is one 8-wide multiply-add per k, in registers.
template <bool ACC>
void small_bmm_range(const float* __restrict A, const float* __restrict Bm, float* __restrict O, int64_t n0, int64_t n1,
                     int64_t M, int64_t K, int64_t sa0, int64_t sa1, int64_t sa2, int64_t sb0, int64_t sb1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict bn = Bm + n * sb0;
    const float* __restrict an = A + n * sa0;
    float* __restrict on = O + n * M * 8;
    for (int64_t i = 0; i < M; ++i) {
      float r[8];
      for (int c = 0; c < 8; ++c) r[c] = ACC ? on[i * 8 + c] : 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float x = an[i * sa1 + k * sa2];
        const float* __restrict br = bn + k * sb1;
        for (int c = 0; c < 8; ++c) r[c] += x * br[c];
      }
      for (int c = 0; c < 8; ++c) on[i * 8 + c] = r[c];
    }
  }
}

void small_bmm(at::Tensor a, at::Tensor b, at::Tensor out, bool accumulate) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && out.dim() == 3, "small_bmm: (N, M, K) @ (N, K, 8) into (N, M, 8)");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "small_bmm: float32 tensors");
  const int64_t N = a.size(0), M = a.size(1), K = a.size(2);
  TORCH_CHECK(b.size(0) == N && b.size(1) == K && b.size(2) == 8 && b.stride(2) == 1,
              "small_bmm: b must be (N, K, 8) with contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == N && out.size(1) == M && out.size(2) == 8,
              "small_bmm: out must be a contiguous (N, M, 8)");
  const float* A = a.data_ptr<float>();
  const float* Bm = b.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t sa0 = a.stride(0), sa1 = a.stride(1), sa2 = a.stride(2), sb0 = b.stride(0), sb1 = b.stride(1);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (accumulate) small_bmm_range<true>(A, Bm, O, n0, n1, M, K, sa0, sa1, sa2, sb0, sb1);
    else small_bmm_range<false>(A, Bm, O, n0, n1, M, K, sa0, sa1, sa2, sb0, sb1);
  });
}

void set_direct_blas(bool on) { direct_blas.store(on); }
void set_pack_keys(bool on) { pack_keys.store(on); }
bool has_direct_blas() { return find_sgemm() != nullptr; }

// One fixed namespace: a process loads one build (its CPU capability's). The functions write into their tensor
// arguments; they are called only inside vispe's autograd functions and custom ops, never traced.
TORCH_LIBRARY(vispe_native, m) {
  m.def("gather_term", &gather_term);  // a block's term, read from its tables by index
  m.def("term_attention_forward", &term_attention_forward);  // a block of query rows with its term, in tiles
  m.def("term_attention_backward", &term_attention_backward);  // the same block's backward, the term's gradient too
  m.def("small_bmm", &small_bmm);  // out (+)= a @ b for a batch of small products with 8 result columns
  // copy each (sample, head)'s strided keys and values once for all its tiles (default) or read them in place
  m.def("set_pack_keys", &set_pack_keys);
  m.def("set_direct_blas", &set_direct_blas);  // call the BLAS sgemm directly (default, where exported) or via addmm_
  m.def("has_direct_blas", &has_direct_blas);  // whether PyTorch's BLAS exports the Fortran sgemm these kernels call
}
