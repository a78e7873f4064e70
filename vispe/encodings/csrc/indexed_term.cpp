// Native CPU kernels for an attention term read from small tables by index (vispe.encodings.native).
//
// A term is a sum of parts. A part reads x[b * sxb + h * sxh + row * sxr + id] for the pair (query r, key j), with row
// the query (or, for a key-side read, the key) and id either
//   * given: idx[b?, r, j] (int32, e.g. iRPE's bucket of the pair), or
//   * an offset id: code_q[b?, r] - code_k[b?, j] + center, or `fill` when either code is negative (prefix tokens),
//     optionally mapped through a lookup table (iRPE's bucket of an offset): the lattice terms. Keys with consecutive
//     codes (a lattice row) have consecutive offset ids, so a row is a few reversed contiguous runs: no index array;
//     without a lookup, vector loads and conflict-free vector adds.
// gather_term builds a block's term (the forward's mask); term_attention_backward runs the recompute backward of a block
// of query rows in tiles of one (sample, head), the logits and their gradient staying in cache between the five
// products and the term's two passes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
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
  int64_t center, fill;

  // the part is shared by the batch: its gradient may take the batch's sum
  bool batch_shared(int64_t B) const { return B > 1 && sgb == 0 && sib == 0 && scq == 0 && runs.size() <= 1; }

  // o[j] += x[.., id(r, j)] for one row of logits of sample b, head h; `row` the block row r, `row_abs` its query index
  void add_row(float* __restrict o, int64_t b, int64_t h, int64_t r, int64_t row_abs, int64_t L) const {
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
    for (const Run& run : rs) {
      float* __restrict oj = o + run.j0;
      if (run.c0 < 0) {
        const float z = xr[fill_id];
        for (int64_t t = 0; t < run.len; ++t) oj[t] += z;
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
  void scatter_row(const float* __restrict o, int64_t b, int64_t h, int64_t r, int64_t row_abs, int64_t L) const {
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
    for (const Run& run : rs) {
      const float* __restrict oj = o + run.j0;
      if (run.c0 < 0) {
        float s = 0.0f;
        for (int64_t t = 0; t < run.len; ++t) s += oj[t];
        gr[fill_id] += s;
      } else if (lut) {  // reversed: the run's ids in increasing key order are lut[base - c0 - t]
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
std::vector<Part> make_parts(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& gs,
                             const std::vector<torch::Tensor>& idxs, const std::vector<torch::Tensor>& cqs,
                             const std::vector<torch::Tensor>& cks, const std::vector<torch::Tensor>& luts,
                             const std::vector<int64_t>& ints, int64_t B, int64_t R, int64_t L) {
  const size_t n = xs.size();
  TORCH_CHECK(gs.size() == n && idxs.size() == n && cqs.size() == n && cks.size() == n && luts.size() == n &&
                  ints.size() == 9 * n,
              "term parts: one table, gradient, index, query codes, key codes and lookup table and 9 ints per part");
  std::vector<Part> parts(n);
  for (size_t p = 0; p < n; ++p) {
    Part& part = parts[p];
    const int64_t* o = ints.data() + 9 * p;
    TORCH_CHECK(xs[p].scalar_type() == torch::kFloat, "term table: float32");
    part.x = xs[p].data_ptr<float>();
    part.sxb = o[0], part.sxh = o[1], part.sxr = o[2];
    const bool grad = gs[p].defined() && gs[p].numel() > 0;
    TORCH_CHECK(!grad || gs[p].scalar_type() == torch::kFloat, "term gradient: float32");
    part.g = grad ? gs[p].data_ptr<float>() : nullptr;
    part.sgb = o[3], part.sgh = o[4], part.sgr = o[5];
    part.key_rows = o[6] != 0;
    part.center = o[7], part.fill = o[8];
    part.idx = nullptr, part.sib = 0, part.cq = nullptr, part.scq = 0, part.lut = nullptr;
    if (idxs[p].numel() > 0) {
      const auto& t = idxs[p];
      TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kInt && t.is_contiguous() && t.size(1) == R && t.size(2) == L &&
                  (t.size(0) == 1 || t.size(0) == B), "ids: contiguous int32 (B|1, rows, L)");
      part.idx = t.data_ptr<int32_t>();
      part.sib = t.size(0) > 1 ? R * L : 0;
    } else {
      const auto &cq = cqs[p], &ck = cks[p];
      TORCH_CHECK(!part.key_rows, "offset ids from codes: query-row reads only");
      TORCH_CHECK(cq.dim() == 2 && cq.scalar_type() == torch::kInt && cq.is_contiguous() && cq.size(1) == R &&
                  (cq.size(0) == 1 || cq.size(0) == B), "query codes: contiguous int32 (B|1, rows)");
      TORCH_CHECK(ck.dim() == 2 && ck.scalar_type() == torch::kInt && ck.is_contiguous() && ck.size(1) == L &&
                  (ck.size(0) == 1 || ck.size(0) == B), "key codes: contiguous int32 (B|1, L)");
      part.cq = cq.data_ptr<int32_t>();
      part.scq = cq.size(0) > 1 ? R : 0;
      if (luts[p].numel() > 0) {
        TORCH_CHECK(luts[p].dim() == 1 && luts[p].scalar_type() == torch::kInt && luts[p].is_contiguous() &&
                    luts[p].numel() > part.fill, "lookup table: contiguous int32 over every offset id");
        part.lut = luts[p].data_ptr<int32_t>();
      }
      for (int64_t b = 0; b < ck.size(0); ++b) part.runs.push_back(key_runs(ck.data_ptr<int32_t>() + b * L, L));
    }
  }
  return parts;
}

}  // namespace

// out (B|1, H, rows, L) = the block's term, rows row0 .. row0 + rows of the sequence.
void gather_term(torch::Tensor out, std::vector<torch::Tensor> xs, std::vector<torch::Tensor> idxs,
                 std::vector<torch::Tensor> cqs, std::vector<torch::Tensor> cks, std::vector<torch::Tensor> luts,
                 std::vector<int64_t> ints, int64_t row0) {
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == torch::kFloat && out.is_contiguous(), "term block: contiguous float32");
  const int64_t B = out.size(0), H = out.size(1), R = out.size(2), L = out.size(3);
  std::vector<torch::Tensor> gs(xs.size());
  const auto parts = make_parts(xs, gs, idxs, cqs, cks, luts, ints, B, R, L);
  float* O = out.data_ptr<float>();
  at::parallel_for(0, B * H * R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / (H * R), h = (n / R) % H, r = n % R;
      float* o = O + n * L;
      std::fill(o, o + L, 0.0f);
      for (const Part& part : parts) part.add_row(o, b, h, r, row0 + r, L);
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
// out = softmax(q k^T + term) v and each row's log-sum-exp. q (B, H, R, D) carries the softmax scale.
void term_attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<torch::Tensor> xs,
                            std::vector<torch::Tensor> idxs, std::vector<torch::Tensor> cqs, std::vector<torch::Tensor> cks,
                            std::vector<torch::Tensor> luts, std::vector<int64_t> ints, torch::Tensor out, torch::Tensor lse,
                            int64_t row0, int64_t tile) {
  for (auto* t : {&q, &k, &v, &out, &lse})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kFloat, "attention tensors: contiguous float32");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), L = k.size(2);
  TORCH_CHECK(tile > 0, "tile rows must be positive");
  std::vector<torch::Tensor> gs(xs.size());
  const auto parts = make_parts(xs, gs, idxs, cqs, cks, luts, ints, B, R, L);
  at::parallel_for(0, B * H, 1, [&](int64_t n0, int64_t n1) {
    torch::Tensor P = torch::empty({tile, L}, q.options());
    std::vector<float> inv(tile);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t b = n / H, h = n % H;
      for (int64_t r0 = 0; r0 < R; r0 += tile) {
        const int64_t tr = std::min(tile, R - r0);
        auto Pt = P.narrow(0, 0, tr);
        at::mm_out(Pt, q[b][h].narrow(0, r0, tr), k[b][h].t());
        float* Pp = Pt.data_ptr<float>();
        float* lse_p = lse.data_ptr<float>() + n * R + r0;
        for (int64_t r = 0; r < tr; ++r) {
          float* o = Pp + r * L;
          for (const Part& part : parts) part.add_row(o, b, h, r0 + r, row0 + r0 + r, L);
          const float m = row_max(o, L);
          const float sum = exp_row_sum(o, m, L);  // o = exp(logits - max)
          inv[r] = 1.0f / sum;
          lse_p[r] = m + std::log(sum);
        }
        auto out_tile = out[b][h].narrow(0, r0, tr);
        at::mm_out(out_tile, Pt, v[b][h]);
        // normalise the (rows, Dv) output rather than the (rows, L) weights
        float* op = out_tile.data_ptr<float>();
        const int64_t dv = out_tile.size(1);
        for (int64_t r = 0; r < tr; ++r)
          for (int64_t c = 0; c < dv; ++c) op[r * dv + c] *= inv[r];
      }
    }
  });
}

// The attention backward of query rows row0 .. row0 + R with the term's gradient (added into the parts' gradients), in
// tiles of `tile` rows of one (sample, head):
//   P = exp(q k^T + term - lse); dV += P^T dO; dS = P * (dO V^T - delta); dQ = dS ks; dK += dS^T q; g += dS
// q (B, H, R, D) carries the softmax scale s and ks = k s; k, v (B, H, L, D); dout (B, H, R, Dv); lse, delta (B, H, R).
// A part shared by the batch gets the batch's dS summed first (one scatter instead of B).
void term_attention_backward(torch::Tensor q, torch::Tensor k, torch::Tensor ks, torch::Tensor v, torch::Tensor dout,
                             torch::Tensor lse, torch::Tensor delta, std::vector<torch::Tensor> xs,
                             std::vector<torch::Tensor> gs, std::vector<torch::Tensor> idxs, std::vector<torch::Tensor> cqs,
                             std::vector<torch::Tensor> cks, std::vector<torch::Tensor> luts, std::vector<int64_t> ints,
                             torch::Tensor dq, torch::Tensor dk,
                             torch::Tensor dv, int64_t row0, int64_t tile) {
  for (auto* t : {&q, &k, &ks, &v, &dout, &lse, &delta, &dq, &dk, &dv})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kFloat, "attention tensors: contiguous float32");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), L = k.size(2);
  TORCH_CHECK(tile > 0, "tile rows must be positive");
  const auto parts = make_parts(xs, gs, idxs, cqs, cks, luts, ints, B, R, L);
  bool serial = false, any_shared = false;  // a gradient shared by the heads: one task adds into it
  for (const Part& p : parts) {
    serial |= p.g && p.sgh == 0;
    any_shared |= p.g && p.batch_shared(B);
  }
  at::parallel_for(0, H, serial ? H : 1, [&](int64_t h0, int64_t h1) {
    torch::Tensor P = torch::empty({tile, L}, q.options());
    torch::Tensor dP = torch::empty({tile, L}, q.options());
    torch::Tensor acc = torch::empty({any_shared ? tile : 0, L}, q.options());
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t r0 = 0; r0 < R; r0 += tile) {
        const int64_t tr = std::min(tile, R - r0);
        auto Pt = P.narrow(0, 0, tr), dPt = dP.narrow(0, 0, tr);
        float* Pp = Pt.data_ptr<float>();
        float* A = any_shared ? acc.data_ptr<float>() : nullptr;
        for (int64_t b = 0; b < B; ++b) {
          auto Q = q[b][h].narrow(0, r0, tr), DO = dout[b][h].narrow(0, r0, tr);
          auto K = k[b][h], V = v[b][h];
          at::mm_out(Pt, Q, K.t());
          const int64_t n0 = (b * H + h) * R + r0;
          const float* lse_p = lse.data_ptr<float>() + n0;
          for (int64_t r = 0; r < tr; ++r) {
            float* __restrict o = Pp + r * L;
            for (const Part& part : parts) part.add_row(o, b, h, r0 + r, row0 + r0 + r, L);
            const float e = lse_p[r];
            for (int64_t j = 0; j < L; ++j) o[j] = exp_approx(o[j] - e);
          }
          dv[b][h].addmm_(Pt.t(), DO);
          at::mm_out(dPt, DO, V.t());
          const float* dPp = dPt.data_ptr<float>();
          const float* delta_p = delta.data_ptr<float>() + n0;
          for (int64_t r = 0; r < tr; ++r) {
            float* __restrict o = Pp + r * L;
            const float* __restrict d = dPp + r * L;
            const float c = delta_p[r];
            for (int64_t j = 0; j < L; ++j) o[j] *= d[j] - c;
            if (A) {
              float* __restrict a = A + r * L;
              if (b == 0) { for (int64_t j = 0; j < L; ++j) a[j] = o[j]; }
              else { for (int64_t j = 0; j < L; ++j) a[j] += o[j]; }
            }
            for (const Part& part : parts)
              if (part.g && !part.batch_shared(B)) part.scatter_row(o, b, h, r0 + r, row0 + r0 + r, L);
          }
          auto dq_tile = dq[b][h].narrow(0, r0, tr);
          at::mm_out(dq_tile, Pt, ks[b][h]);
          dk[b][h].addmm_(Pt.t(), Q);
        }
        if (A) {
          for (int64_t r = 0; r < tr; ++r)
            for (const Part& part : parts)
              if (part.g && part.batch_shared(B)) part.scatter_row(A + r * L, 0, h, r0 + r, row0 + r0 + r, L);
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_term", &gather_term, "a block's term, read from its tables by index");
  m.def("term_attention_forward", &term_attention_forward,
        "the attention forward of a block of query rows with its term, in cache-sized tiles");
  m.def("term_attention_backward", &term_attention_backward,
        "the attention backward of a block of query rows with its term's gradient, in cache-sized tiles");
}
