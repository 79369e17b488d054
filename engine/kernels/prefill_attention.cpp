// Causal attention of one prompt chunk over its paged context, bfloat16, on CPUs with
// AVX512_BF16: the prefill half of what paged_decode_attention (cpu_ops.cpp) does for decodes.
//
// torch's CPU flash kernel reaches 50-90 GFLOP/s in bfloat16 on a 2-core AVX-512 BF16 EPYC
// (250 to 1000 positions, 9 query and 3 KV heads of 64), a third of a 1k-token prefill. Here
// both products are vdpbf16ps with one operand broadcast, so nothing is transposed or reduced
// across lanes inside the loop:
//   scores: lane j of a register = key j of a 16-key tile; per pair of dims, one vdpbf16ps of
//     the query row's two bf16 values (broadcast) with the tile's keys, transposed once per
//     call into [pair of dims][key] order (kt below);
//   values: lane d = one dim; per pair of keys, one vdpbf16ps of the row's two probabilities
//     (broadcast) with the tile's value rows interleaved pairwise (vp below).
// Probabilities are rounded to bf16 for the second product and the softmax denominator sums
// the same rounded values, as the decode kernel does.
//
// Work: one task per (KV head, tile of 16 query positions), every query head of the KV head's
// group in it (16 * G score rows sharing each key tile). Tasks are ordered so that each
// contiguous half of them (what a thread of at::parallel_for gets) holds as many long rows
// (late positions) as short ones.
#include "torch_ops.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kTile = 16;  // keys per tile (lanes of one float32 register) and queries per task

// The context's keys and values of one KV head, rearranged for broadcast products:
//   kt [tiles][D / 2][16] uint32: (key j, dims 2p and 2p + 1) at [tile][p][j];
//   vp [tiles][8][D] uint32: (keys 2i and 2i + 1 of the tile, dim d) at [tile][i][d].
// Keys at and past seq_len are zero (the cache may hold anything there, NaN too).
template <int D>
void rearrange_head(const uint16_t* cache, const int64_t* table, int64_t block_size, int64_t kv_heads,
                    int64_t head, int64_t seq_len, int64_t tile, uint32_t* kt, uint32_t* vp) {
  const int64_t slot_stride = 2 * kv_heads * D;
  uint16_t keys[kTile][D], values[kTile][D];
  for (int64_t j = 0; j < kTile; ++j) {
    const int64_t pos = tile * kTile + j;
    if (pos >= seq_len) {
      std::memset(keys[j], 0, sizeof(keys[j]));
      std::memset(values[j], 0, sizeof(values[j]));
      continue;
    }
    const uint16_t* slot = cache + (table[pos / block_size] * block_size + pos % block_size) * slot_stride;
    std::memcpy(keys[j], slot + head * D, sizeof(keys[j]));
    std::memcpy(values[j], slot + (kv_heads + head) * D, sizeof(values[j]));
  }
  for (int p = 0; p < D / 2; ++p)
    for (int j = 0; j < kTile; ++j)
      kt[p * kTile + j] = static_cast<uint32_t>(keys[j][2 * p]) | static_cast<uint32_t>(keys[j][2 * p + 1]) << 16;
  for (int i = 0; i < kTile / 2; ++i)
    for (int d = 0; d < D; ++d)
      vp[i * D + d] = static_cast<uint32_t>(values[2 * i][d]) | static_cast<uint32_t>(values[2 * i + 1][d]) << 16;
}

// One task's running state, per score row r = query position i (of the task's 16) * G + g.
template <int D>
struct RowState {
  std::vector<uint32_t> q;      // [rows, D / 2]: the row's query, bf16 pairs (zero past the chunk)
  std::vector<float> acc;       // [rows, D]: unnormalised output
  std::vector<float> m, l;      // [rows]: running max and (rounded) probability sum
  std::vector<float> scale_by;  // [rows]: this tile's correction of acc
  std::vector<uint32_t> probs;  // [rows, 8]: this tile's probabilities, bf16 pairs
  explicit RowState(int64_t rows)
      : q(rows * D / 2), acc(rows * D), m(rows), l(rows), scale_by(rows), probs(rows * kTile / 2) {}
};

// Scores of 16 rows (from `first`) against one key tile, scaled, masked past each row's
// position, folded into the rows' softmax state; the tile's probabilities go to st.probs.
template <int D>
void score_rows(RowState<D>& st, int64_t first, const uint32_t* kt, float scale, int64_t tile_pos,
                const int64_t* row_pos) {
  __m512 s[kTile];
  for (int j = 0; j < kTile; ++j) s[j] = _mm512_setzero_ps();
  const uint32_t* q = st.q.data() + first * (D / 2);
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh keys = (__m512bh)_mm512_loadu_si512(kt + p * kTile);
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j)
      s[j] = _mm512_dpbf16_ps(s[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[j * (D / 2) + p])), keys);
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int j = 0; j < kTile; ++j) {
    const int64_t r = first + j;
    const int64_t visible = std::clamp<int64_t>(row_pos[r] - tile_pos + 1, 0, kTile);  // keys <= the row's position
    const __mmask16 keep = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(visible)));
    const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_mul_ps(s[j], _mm512_set1_ps(scale)));
    const float m_old = st.m[r], m_new = std::max(m_old, _mm512_reduce_max_ps(x));
    if (m_new == -INFINITY) {  // nothing visible yet (only rows past the chunk's end): no change
      st.scale_by[r] = 1.f;
      std::memset(st.probs.data() + r * (kTile / 2), 0, kTile * sizeof(uint16_t));
      continue;
    }
    const float correction = m_new == m_old ? 1.f : std::exp(m_old - m_new);  // 0 on the first tile
    vec16 shifted;
    const __m512 diff = _mm512_sub_ps(x, _mm512_set1_ps(m_new));
    std::memcpy(&shifted, &diff, sizeof(shifted));
    const __m512 e = _mm512_maskz_mov_ps(keep, (__m512)exp16_nonpositive(shifted));
    const __m256bh rounded = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(st.probs.data() + r * (kTile / 2)), (__m256i)rounded);
    st.m[r] = m_new;
    st.l[r] = st.l[r] * correction + _mm512_reduce_add_ps(_mm512_cvtpbh_ps(rounded));
    st.scale_by[r] = correction;
  }
}

// acc[r] = acc[r] * scale_by[r] + probs[r] . values, for RB rows at a time (the value tile's
// registers loaded once for them).
template <int D, int RB>
void accumulate_rows(RowState<D>& st, int64_t first, int64_t count, const uint32_t* vp) {
  constexpr int NC = D / 16;
  for (int64_t r0 = first; r0 < first + count; r0 += RB) {
    const int nr = static_cast<int>(std::min<int64_t>(RB, first + count - r0));
    __m512 acc[RB][NC];
    for (int b = 0; b < nr; ++b) {
      const __m512 by = _mm512_set1_ps(st.scale_by[r0 + b]);
      for (int c = 0; c < NC; ++c) acc[b][c] = _mm512_mul_ps(_mm512_loadu_ps(st.acc.data() + (r0 + b) * D + c * 16), by);
    }
    for (int i = 0; i < kTile / 2; ++i) {
      __m512bh v[NC];
      for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + i * D + c * 16);
      for (int b = 0; b < nr; ++b) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(st.probs[(r0 + b) * (kTile / 2) + i]));
        for (int c = 0; c < NC; ++c) acc[b][c] = _mm512_dpbf16_ps(acc[b][c], w, v[c]);
      }
    }
    for (int b = 0; b < nr; ++b)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(st.acc.data() + (r0 + b) * D + c * 16, acc[b][c]);
  }
}

template <int D, int G>
void attend_task(const uint16_t* query, int64_t q_tok, int64_t q_head, int64_t q_len, int64_t q_start,
                 int64_t head, int64_t q_tile, const uint32_t* kt, const uint32_t* vp, float scale, uint16_t* out,
                 int64_t heads, RowState<D>& st) {
  constexpr int64_t R = kTile * G;
  const int64_t first_q = q_tile * kTile, num_q = std::min(kTile, q_len - first_q);
  int64_t row_pos[R];
  std::fill(st.q.begin(), st.q.end(), 0u);
  std::fill(st.acc.begin(), st.acc.end(), 0.f);
  std::fill(st.m.begin(), st.m.end(), -INFINITY);
  std::fill(st.l.begin(), st.l.end(), 0.f);
  for (int64_t i = 0; i < kTile; ++i)
    for (int g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      row_pos[r] = i < num_q ? q_start + first_q + i : -1;  // -1: past the chunk, sees nothing
      if (i < num_q)
        std::memcpy(st.q.data() + r * (D / 2), query + (first_q + i) * q_tok + (head * G + g) * q_head,
                    D * sizeof(uint16_t));
    }
  const int64_t last_pos = q_start + first_q + num_q - 1;
  constexpr int RB = D == 64 ? 4 : 2;
  for (int64_t tile = 0; tile * kTile <= last_pos; ++tile) {
    for (int64_t first = 0; first < R; first += kTile)
      score_rows<D>(st, first, kt + tile * (D / 2) * kTile, scale, tile * kTile, row_pos);
    accumulate_rows<D, RB>(st, 0, num_q * G, vp + tile * (kTile / 2) * D);
  }
  for (int64_t r = 0; r < num_q * G; ++r) {
    const int64_t i = r / G, g = r % G;
    const __m512 inv = _mm512_set1_ps(1.f / st.l[r]);
    uint16_t* dst = out + ((first_q + i) * heads + head * G + g) * D;
    for (int c = 0; c < D / 16; ++c) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(st.acc.data() + r * D + c * 16), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16), (__m256i)y);
    }
  }
}

// Task k -> (KV head, query tile): heads interleaved, and within a head the tiles in the order
// 0, T-1, 1, T-2, ... so that any contiguous run of tasks mixes short and long rows.
inline void task_of(int64_t k, int64_t kv_heads, int64_t tiles, int64_t& head, int64_t& q_tile) {
  head = k % kv_heads;
  const int64_t j = k / kv_heads;
  q_tile = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;
}

template <int D, int G>
void prefill_attention(const uint16_t* query, int64_t q_tok, int64_t q_head, int64_t q_len, const uint16_t* cache,
                       const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t seq_len, float scale,
                       uint16_t* out) {
  const int64_t key_tiles = (seq_len + kTile - 1) / kTile, q_tiles = (q_len + kTile - 1) / kTile;
  const int64_t kt_size = key_tiles * (D / 2) * kTile, vp_size = key_tiles * (kTile / 2) * D;
  std::vector<uint32_t> kt(kv_heads * kt_size), vp(kv_heads * vp_size);
  at::parallel_for(0, kv_heads * key_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t head = k / key_tiles, tile = k % key_tiles;
      rearrange_head<D>(cache, table, block_size, kv_heads, head, seq_len, tile,
                        kt.data() + head * kt_size + tile * (D / 2) * kTile,
                        vp.data() + head * vp_size + tile * (kTile / 2) * D);
    }
  });
  const int64_t heads = kv_heads * G, q_start = seq_len - q_len;
  at::parallel_for(0, kv_heads * q_tiles, 1, [&](int64_t begin, int64_t end) {
    RowState<D> st(kTile * G);
    for (int64_t k = begin; k < end; ++k) {
      int64_t head, q_tile;
      task_of(k, kv_heads, q_tiles, head, q_tile);
      attend_task<D, G>(query, q_tok, q_head, q_len, q_start, head, q_tile, kt.data() + head * kt_size,
                        vp.data() + head * vp_size, scale, out, heads, st);
    }
  });
}

template <int D>
bool prefill_attention_group(int64_t group, const uint16_t* query, int64_t q_tok, int64_t q_head, int64_t q_len,
                             const uint16_t* cache, const int64_t* table, int64_t block_size, int64_t kv_heads,
                             int64_t seq_len, float scale, uint16_t* out) {
  return with_group(group, [&](auto g) {
    prefill_attention<D, decltype(g)::value>(query, q_tok, q_head, q_len, cache, table, block_size, kv_heads,
                                             seq_len, scale, out);
  });
}
#endif  // __AVX512BF16__

bool available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// query [q_len, heads, head_dim] bf16 (unit stride in head_dim): the chunk's queries, at
// positions [seq_len - q_len, seq_len); kv_cache [blocks, block_size, 2 * kv_heads, head_dim]
// bf16, holding the chunk's own keys and values already; block_table [>= ceil(seq_len /
// block_size)] int64. Returns [q_len, heads, head_dim] bf16.
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   int64_t seq_len, double scale) {
  TORCH_CHECK(available(), "paged_prefill_attention: built without AVX512_BF16");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: bf16 query [q_len, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: contiguous bf16 kv_cache [blocks, block_size, 2 * kv_heads, head_dim]");
  TORCH_CHECK(block_table.dim() == 1 && block_table.is_contiguous() && block_table.scalar_type() == at::kLong,
              "paged_prefill_attention: int64 block_table [blocks]");
  const int64_t q_len = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(1), kv_heads = kv_cache.size(2) / 2;
  TORCH_CHECK(kv_cache.size(3) == head_dim && heads % kv_heads == 0, "paged_prefill_attention: head shapes");
  TORCH_CHECK(q_len >= 1 && seq_len >= q_len && seq_len <= block_table.numel() * block_size,
              "paged_prefill_attention: bad lengths (q_len ", q_len, ", seq_len ", seq_len, ")");
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_prefill_attention: block id ", table[b], " out of range");
  auto out = at::empty({q_len, heads, head_dim}, query.options());
  bool done = false;
#if defined(__AVX512BF16__)
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* cache = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = heads / kv_heads;
  const float sc = static_cast<float>(scale);
  if (head_dim == 64)
    done = prefill_attention_group<64>(group, q, query.stride(0), query.stride(1), q_len, cache, table, block_size,
                                       kv_heads, seq_len, sc, o);
  else if (head_dim == 128)
    done = prefill_attention_group<128>(group, q, query.stride(0), query.stride(1), q_len, cache, table,
                                        block_size, kv_heads, seq_len, sc, o);
#endif
  TORCH_CHECK(done, "paged_prefill_attention: head_dim 64 or 128 and 1-8 query heads per KV head only");
  return out;
}

bool supports(int64_t head_dim, int64_t group) {
  return available() && (head_dim == 64 || head_dim == 128) && group >= 1 && group <= 8;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL while it computes (cpu_ops.cpp says why).
  const auto kNoGil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal prompt-chunk attention through a block table", kNoGil);
  m.def("supports", &supports, "whether this build takes (head_dim, query heads per KV head)");
}
