// Packed sample index for megatron_mlmclm (C++17, pybind11).
//
// Documents (lengths[d] tokens each, zeros allowed) are shuffled per epoch and laid end to end in
// one flat token stream. Packed sample i covers flat positions [i*S, i*S + S] (S + 1 tokens:
// inputs and shifted targets), so consecutive packed samples share one token, exactly like
// Megatron's GPTDataset. Sample i belongs to the epoch of its first token: epoch e holds samples
// [ceil(e*T/S), ceil((e+1)*T/S)) for epochs of T tokens. An index of E epochs packs every sample
// of those epochs, M = ceil(E*T/S), even when fewer are asked for, so that the sample shuffle
// below can draw the first stream positions from the whole of the last epoch, as Megatron does;
// the last sample of an epoch ends in the next one, so the documents are laid out (and shuffled)
// as far into epoch E as that sample reaches.
//
// The order is a function of (lengths, S, seed) alone: every permutation is seeded by its epoch,
// and epoch e's samples are the same whatever E is, so an index asked for N samples and one asked
// for N' > N agree on their first N stream positions (a longer run reads what a shorter one read,
// then more).
//
// Outputs (all built with the GIL released, no Python loop anywhere):
//   doc_idx          int32  [E*D + k]  the shuffled document order, epoch after epoch, then the
//                                     first k documents of epoch E's order that the last sample
//                                     reaches into (more epochs when one holds fewer than S tokens)
//   sample_idx       int64  [M+1, 2]  (position in doc_idx, token offset in that document) of the
//                                     first token of packed sample i; row M is the last sample's
//                                     final token. The position always names a document that
//                                     contains the token (leading/in-between empty documents are
//                                     skipped), which is Megatron's layout for every row but row 0.
//   boundary_ptr     int64  [M+1]     CSR row pointers into boundary_offsets
//   boundary_offsets int32  [nnz]     offsets in 1..S inside packed sample i's window where a new
//                                     (non-empty) document starts; offset 0 is never stored.
//   shuffle_idx      int32  [M]       (int64 beyond 2^31-1 samples) stream position k reads packed
//                                     sample shuffle_idx[k]
//
// Two shuffles, both Fisher-Yates driven by splitmix64 with bounded draws by Lemire's
// multiply-shift with rejection; integer-only, so identical on every machine and rank:
//   documents, per epoch, seeded from (seed, epoch, kDocStream): which documents follow which;
//   samples, per epoch, seeded from (seed, epoch, kSampleStream): without it adjacent stream
//     positions are adjacent windows of one token stream, so every global batch is a stretch of
//     one or two long documents. Epoch e's block (above) is permuted in place, so the stream
//     still finishes epoch e before it starts epoch e + 1 (a document is not seen twice before
//     every other was seen once), and a stream that stops inside the last epoch reads a uniform
//     sample of that whole epoch.
//
// Blending: build_blend_index places blended samples by Tijdeman's chairman-assignment rule
// (earliest due date among released datasets), so every prefix of n samples holds n * w[d]
// samples of dataset d to within 1 - 1/(2k-2) < 1 sample.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

inline uint64_t splitmix64_next(uint64_t &state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The two independent permutation families: words of the SHA-512 initial hash value.
struct Stream {
  uint64_t a, b;
};
constexpr Stream kDocStream{0x6A09E667F3BCC909ULL, 0xBB67AE8584CAA73BULL};
constexpr Stream kSampleStream{0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL};

inline uint64_t mix_seed(uint64_t seed, uint64_t epoch, Stream stream) {
  uint64_t s = seed ^ stream.a;
  uint64_t a = splitmix64_next(s);
  uint64_t t = epoch ^ a ^ stream.b;
  return splitmix64_next(t);
}

// Uniform integer in [0, range) (range >= 1), Lemire's nearly divisionless method.
inline uint64_t bounded(uint64_t &state, uint64_t range) {
  uint64_t x = splitmix64_next(state);
  __uint128_t m = static_cast<__uint128_t>(x) * range;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < range) {
    const uint64_t threshold = (0 - range) % range;
    while (low < threshold) {
      x = splitmix64_next(state);
      m = static_cast<__uint128_t>(x) * range;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

// out[0..n) = base + a Fisher-Yates permutation of range(n), drawn from `state`.
template <typename I>
void permute(I *out, int64_t n, int64_t base, uint64_t state) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<I>(base + i);
  // The swap targets do not depend on the array contents, so draw them kLead steps ahead and
  // prefetch their cache lines: the permutation is the plain Fisher-Yates one, only faster.
  constexpr int64_t kLead = 32;
  int64_t ring[kLead];
  const int64_t first = n - 1;
  int64_t drawn = 0;  // draws made so far; draw t belongs to i = first - t
  for (; drawn < kLead && first - drawn > 0; ++drawn) {
    const int64_t i = first - drawn;
    const int64_t j = static_cast<int64_t>(bounded(state, static_cast<uint64_t>(i + 1)));
    ring[drawn % kLead] = j;
    __builtin_prefetch(out + j, 1);
  }
  for (int64_t t = 0; first - t > 0; ++t) {
    const int64_t i = first - t;
    const int64_t j = ring[t % kLead];
    if (first - drawn > 0) {
      const int64_t ii = first - drawn;
      const int64_t jj = static_cast<int64_t>(bounded(state, static_cast<uint64_t>(ii + 1)));
      ring[drawn % kLead] = jj;
      __builtin_prefetch(out + jj, 1);
      ++drawn;
    }
    const I tmp = out[i];
    out[i] = out[j];
    out[j] = tmp;
  }
}

// The first packed sample of epoch e: ceil(e*T/S), the first whose first token lies in epoch e.
inline int64_t epoch_start(int64_t e, int64_t tokens_per_epoch, int64_t seq_length) {
  const __int128 t = static_cast<__int128>(e) * tokens_per_epoch;
  return static_cast<int64_t>((t + seq_length - 1) / seq_length);
}

// Epoch e's block of packed samples, [first, end): those whose first token i*S lies in epoch e.
template <typename I>
void shuffle_samples(I *out, int64_t epochs, int64_t tokens_per_epoch, int64_t seq_length,
                     uint64_t seed) {
  for (int64_t e = 0; e < epochs; ++e) {
    const int64_t first = epoch_start(e, tokens_per_epoch, seq_length);
    const int64_t end = epoch_start(e + 1, tokens_per_epoch, seq_length);
    permute(out + first, end - first, first, mix_seed(seed, e, kSampleStream));
  }
}

template <typename T>
py::array_t<T> owned_array(T *data, std::vector<py::ssize_t> shape) {
  py::capsule owner(data, [](void *p) { std::free(p); });
  return py::array_t<T>(shape, data, owner);
}

// Epochs E, packed samples M (every sample of E epochs), stream length N (num_samples, or M) and
// the epochs whose document order the packing reads (E, and more as far as sample M-1 reaches).
// tokens_per_epoch > 0 is checked by the caller.
void plan(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t num_epochs,
          int64_t &epochs_out, int64_t &packed_out, int64_t &stream_out, int64_t &laid_out) {
  const __int128 T = tokens_per_epoch;
  if (num_samples >= 0) {
    // Smallest E >= 1 with ceil(E*T/S) >= N, i.e. E*T >= (N-1)*S + 1.
    const __int128 need = static_cast<__int128>(num_samples - 1) * seq_length + 1;
    const __int128 e = need <= T ? 1 : (need + T - 1) / T;
    if (e > std::numeric_limits<int32_t>::max()) throw std::invalid_argument("too many epochs");
    epochs_out = static_cast<int64_t>(e);
  } else {
    epochs_out = num_epochs;
  }
  const __int128 packed = (static_cast<__int128>(epochs_out) * T + seq_length - 1) / seq_length;
  if (packed >= std::numeric_limits<int64_t>::max() / (2 * seq_length))
    throw std::invalid_argument("too many samples");
  packed_out = static_cast<int64_t>(packed);
  stream_out = num_samples >= 0 ? num_samples : packed_out;
  // The final token, at flat position M*S, must exist: epochs until the stream holds M*S + 1.
  const __int128 laid = (packed * seq_length + 1 + T - 1) / T;
  if (laid > std::numeric_limits<int32_t>::max()) throw std::invalid_argument("too many epochs");
  laid_out = static_cast<int64_t>(laid);
}

py::dict build_sample_index(py::array_t<int32_t, py::array::c_style | py::array::forcecast> lengths_,
                            int64_t seq_length, uint64_t seed, int64_t num_samples,
                            int64_t num_epochs) {
  if (lengths_.ndim() != 1) throw std::invalid_argument("lengths must be 1-D");
  if (seq_length < 1) throw std::invalid_argument("seq_length must be >= 1");
  if ((num_samples < 0) == (num_epochs < 0))
    throw std::invalid_argument("give exactly one of num_samples and num_epochs");
  if (num_epochs == 0) throw std::invalid_argument("num_epochs must be >= 1");
  const int64_t num_docs = lengths_.shape(0);
  if (num_docs > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("more than 2^31-1 documents");
  const int32_t *lengths = lengths_.data();

  int64_t tokens_per_epoch = 0;
  for (int64_t d = 0; d < num_docs; ++d) {
    if (lengths[d] < 0) throw std::invalid_argument("document lengths must be >= 0");
    tokens_per_epoch += lengths[d];
  }
  if (tokens_per_epoch == 0) throw std::invalid_argument("the corpus has no tokens");

  int64_t epochs = 0, n = 0, stream = 0, laid = 0;  // n: packed samples (M above); stream: N
  plan(tokens_per_epoch, seq_length, num_samples, num_epochs, epochs, n, stream, laid);
  const int64_t doc_total = laid * num_docs;  // documents laid out; those past row M are dropped
  const bool wide = n > std::numeric_limits<int32_t>::max();  // shuffle_idx needs int64
  const size_t shuffle_item = wide ? sizeof(int64_t) : sizeof(int32_t);

  // Allocations: untouched pages of the over-sized boundary buffer cost no memory, and the final
  // realloc gives them back.
  int32_t *doc_idx = static_cast<int32_t *>(std::malloc(sizeof(int32_t) * std::max<int64_t>(doc_total, 1)));
  int64_t *sample_idx = static_cast<int64_t *>(std::malloc(sizeof(int64_t) * 2 * (n + 1)));
  int64_t *ptr = static_cast<int64_t *>(std::malloc(sizeof(int64_t) * (n + 1)));
  int32_t *offs = static_cast<int32_t *>(std::malloc(sizeof(int32_t) * std::max<int64_t>(doc_total, 1)));
  void *shuffle = std::malloc(shuffle_item * std::max<int64_t>(n, 1));
  if (!doc_idx || !sample_idx || !ptr || !offs || !shuffle) {
    std::free(doc_idx); std::free(sample_idx); std::free(ptr); std::free(offs);
    std::free(shuffle);
    throw std::bad_alloc();
  }

  int64_t nnz = 0;
  {
    py::gil_scoped_release release;
    for (int64_t e = 0; e < laid; ++e)
      permute(doc_idx + e * num_docs, num_docs, 0, mix_seed(seed, e, kDocStream));

    const int64_t last = n * seq_length;  // flat position of the final token (row M)
    int64_t next_start = 0;               // next sample_idx row to fill (its position: k*S)
    int64_t next_start_pos = 0;
    int64_t ptr_filled = 0;               // rows of ptr written so far
    int64_t win = 0;                      // sample whose window (win*S, win*S+S] holds p
    int64_t win_end = seq_length;
    int64_t p = 0;                        // flat position of the current document's first token
    constexpr int64_t kAhead = 16;  // prefetch distance for the random reads of lengths[]
    for (int64_t j = 0; j < doc_total && p <= last; ++j) {
      if (j + kAhead < doc_total) __builtin_prefetch(lengths + doc_idx[j + kAhead], 0);
      const int64_t len = lengths[doc_idx[j]];
      if (len == 0) continue;
      if (p > 0) {  // a document start inside (0, last]: a boundary of exactly one sample
        while (p > win_end) { ++win; win_end += seq_length; }
        while (ptr_filled <= win) ptr[ptr_filled++] = nnz;
        offs[nnz++] = static_cast<int32_t>(p - win * seq_length);
      }
      const int64_t end = p + len;
      while (next_start <= n && next_start_pos < end) {
        sample_idx[2 * next_start] = j;
        sample_idx[2 * next_start + 1] = next_start_pos - p;
        ++next_start;
        next_start_pos += seq_length;
      }
      p = end;
    }
    while (ptr_filled <= n) ptr[ptr_filled++] = nnz;

    const int64_t T = tokens_per_epoch;
    if (wide) shuffle_samples(static_cast<int64_t *>(shuffle), epochs, T, seq_length, seed);
    else shuffle_samples(static_cast<int32_t *>(shuffle), epochs, T, seq_length, seed);
  }
  // Documents after the one holding the final token are never read.
  const int64_t docs_used = sample_idx[2 * n] + 1;
  int32_t *doc_shrunk = static_cast<int32_t *>(std::realloc(doc_idx, sizeof(int32_t) * docs_used));
  if (doc_shrunk) doc_idx = doc_shrunk;

  int32_t *shrunk = static_cast<int32_t *>(std::realloc(offs, sizeof(int32_t) * std::max<int64_t>(nnz, 1)));
  if (shrunk) offs = shrunk;

  py::dict out;
  out["doc_idx"] = owned_array<int32_t>(doc_idx, {static_cast<py::ssize_t>(docs_used)});
  out["sample_idx"] = owned_array<int64_t>(sample_idx, {static_cast<py::ssize_t>(n + 1), 2});
  out["boundary_ptr"] = owned_array<int64_t>(ptr, {static_cast<py::ssize_t>(n + 1)});
  out["boundary_offsets"] = owned_array<int32_t>(offs, {static_cast<py::ssize_t>(nnz)});
  const std::vector<py::ssize_t> m{static_cast<py::ssize_t>(n)};
  if (wide) out["shuffle_idx"] = owned_array<int64_t>(static_cast<int64_t *>(shuffle), m);
  else out["shuffle_idx"] = owned_array<int32_t>(static_cast<int32_t *>(shuffle), m);
  out["num_epochs"] = epochs;
  out["num_samples"] = stream;
  out["tokens_per_epoch"] = tokens_per_epoch;
  return out;
}

py::tuple build_blend_index(py::array_t<double, py::array::c_style | py::array::forcecast> weights_,
                            int64_t size) {
  if (weights_.ndim() != 1 || weights_.shape(0) < 1)
    throw std::invalid_argument("weights must be a non-empty 1-D array");
  if (size < 0) throw std::invalid_argument("size must be >= 0");
  const int64_t k = weights_.shape(0);
  if (k > std::numeric_limits<int32_t>::max()) throw std::invalid_argument("too many datasets");
  std::vector<double> w(weights_.data(), weights_.data() + k);
  double total = 0.0;
  for (double x : w) {
    if (!(x > 0.0) || x == std::numeric_limits<double>::infinity())
      throw std::invalid_argument("weights must be finite and > 0");
    total += x;
  }
  for (double &x : w) x /= total;

  const bool small = k <= std::numeric_limits<int16_t>::max();
  py::array out_index = small ? py::array(py::array_t<int16_t>(size)) : py::array(py::array_t<int32_t>(size));
  py::array_t<int64_t> out_sample(size);
  void *index_raw = out_index.mutable_data();
  int64_t *sample = out_sample.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> count(k, 0);
    // Tijdeman's chairman assignment: the c-th sample of dataset d may go at step n once
    // c <= w[d]*n + lam and is due when w[d]*n > c - 1 + lam; earliest due date first keeps
    // |count[d] - w[d]*n| <= lam = 1 - 1/(2k-2) < 1 at every n.
    const double lam = k > 1 ? 1.0 - 1.0 / (2.0 * static_cast<double>(k) - 2.0) : 1.0;
    for (int64_t i = 0; i < size; ++i) {
      const double n = static_cast<double>(i + 1);
      int64_t best = -1;
      double best_due = std::numeric_limits<double>::infinity();
      for (int64_t d = 0; d < k; ++d) {
        const double c = static_cast<double>(count[d]);
        if (c + 1.0 > w[d] * n + lam + 1e-9) continue;  // not released yet
        const double due = (c + lam) / w[d];
        if (due < best_due) { best_due = due; best = d; }
      }
      if (best < 0) {  // unreachable in exact arithmetic; fall back to the largest deficit
        best = 0;
        double best_err = -std::numeric_limits<double>::infinity();
        for (int64_t d = 0; d < k; ++d) {
          const double err = w[d] * n - static_cast<double>(count[d]);
          if (err > best_err) { best_err = err; best = d; }
        }
      }
      if (small) static_cast<int16_t *>(index_raw)[i] = static_cast<int16_t>(best);
      else static_cast<int32_t *>(index_raw)[i] = static_cast<int32_t>(best);
      sample[i] = count[best]++;
    }
  }
  return py::make_tuple(out_index, out_sample);
}

}  // namespace

PYBIND11_MODULE(_sample_index, m) {
  m.doc() = "Packed sample index and blend index builders (see csrc/sample_index.cpp).";
  m.def("build_sample_index", &build_sample_index, py::arg("lengths"), py::arg("seq_length"),
        py::arg("seed"), py::arg("num_samples") = -1, py::arg("num_epochs") = -1,
        "Shuffle documents per epoch, pack them into samples of seq_length+1 tokens, shuffle "
        "the samples per epoch.");
  m.def("build_blend_index", &build_blend_index, py::arg("weights"), py::arg("size"),
        "Greedy deficit-minimising assignment of blended samples to datasets.");
}
