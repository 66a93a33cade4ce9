// sampler: one decode step's token choice for a batch of sequences, on the device (launcher: src/ops/sampler/mod.rs).
// The CPU oracle is model::sampler (`Sampler::distribution` + the draw of `Sampler::sample`, the loop of `generate`):
// this kernel reproduces its order of operations, so the chosen id is the CPU's on the same logits and draw.
//
// Per sequence b (one CTA of 1024 threads; grid = batch capacity):
//   status[b] != RUNNING              -> sampled[b] = next[b] = -1, nothing else.
//   steps[b] >= max_new_tokens        -> status MAX_TOKENS, sampled = next = -1 (the CPU loop checks first).
//   a NaN logit                       -> status FAILED, *error |= ERR_NAN_LOGIT (the CPU bails).
//   otherwise choose id (below); sampled[b] = id; if id is in the stop set: status STOPPED, next = -1 (the stop
//   token is not appended); else next = id, steps += 1, and id enters the penalty history (ring + counts).
// next[] is the buffer the next step's embedding reads (kernels/head.cu: an id < 0 is an empty row).
//
// The choice, in the CPU's order (V = vocab, T = temperature):
//   l_i = logit_i, penalized when counts[b][i] > 0 (l > 0 ? l / pen : l * pen; off when pen == 1 or window == 0);
//   the CPU sorts by (l desc, index asc). Here the same order is a key: key_i = ord(l_i) << 17 | (2^17 - 1 - i),
//   ord() the order-preserving map of f32 bits (-0 canonicalized to +0: the CPU's partial_cmp calls them equal), so
//   "descending key" is exactly the CPU's order and every key is distinct (V <= 2^17).
//   T == 0 or top-k 1: the id of the largest key (argmax, the lower id wins ties).
//   top-k (0 < k < V): the set is key >= the k-th largest key.
//   top-p (< 1): e_i = exp((double)((l_i - mx) / T)) (f32 subtract and divide, f64 exp; mx = the largest l) over the
//   top-k set, Z = sum e_i, q_i = e_i / Z (f64); the kept set ends at the first element, in key order, where the
//   running sum of q reaches top_p (none: all kept).
//   The draw (model::sampler::Sampler::sample_at): the exponential race of DeepSeek's own inference code (argmax of
//   p / E, E ~ Exp(1) per id) in the log domain: id = the largest make_key(race_key(l_i, T, race_bits(seed, step,
//   i)), i) over the kept set, race_key = l / T + g with g = -ln(-ln U) a Gumbel draw from the id's bits, every
//   operation an IEEE f32 op or fma in the CPU's order (ln_ieee), so the keys are the CPU's bit for bit.
// "The first element in key order where a running sum reaches a threshold" (the k-th key, the top-p end) is found
// without a sort by a radix descent over the 49-bit key: 7 levels of 7-bit digits; at each level one pass over the
// row histograms the weight, count and largest key of the elements under the current key prefix by digit, and one
// thread walks the 128 digits from the top; a chosen digit holding one element ends the descent early. Weight sums
// are f64 (shared-memory atomics, so their order varies at the 1e-16 level; the CPU sums sequentially): the kept
// set equals the CPU's unless top_p lies within ~1e-15 relative of a boundary of the running sum. Counts are exact.
//
// Cost: one CTA per sequence reads the row once per pass (the first as float4): greedy and top-k 1: 1 pass;
// temperature 2 (max, race), + up to 7 with top-k, + 2 (e, q) and up to 7 with top-p (fewer when a chosen digit
// holds one element). The max and the race split across CTAs (a last-CTA reduction) would make the plain paths
// fast at batch 1.
//
// Penalty history per sequence: counts[b][V] (u16: occurrences among the last `window` history tokens, prompt
// included), ring[b][ring_cap] (history token n at slot n % window), hist_len[b]. The host seeds them from the
// prompt (src/ops/sampler `HistoryTables`).
#include <stdint.h>

namespace {

constexpr int THREADS = 1024;
constexpr int WARPS = THREADS / 32;
constexpr int INDEX_BITS = 17;
constexpr uint32_t INDEX_MASK = (1u << INDEX_BITS) - 1;
constexpr int DIGIT_BITS = 7;
constexpr int BUCKETS = 1 << DIGIT_BITS;
constexpr int LEVELS = (32 + INDEX_BITS) / DIGIT_BITS;  // 49 bits = 7 x 7
constexpr int HIST_COPIES = 16;                          // warps 2c and 2c+1 share histogram copy c
constexpr int MAX_STOP = 16;

constexpr int RUNNING = 0, STOPPED = 1, MAX_TOKENS = 2, FAILED = 3;
constexpr uint32_t ERR_NAN_LOGIT = 1u, ERR_BAD_PARAMS = 2u;

// Must match ops::sampler::SamplerParams (#[repr(C)], 32 bytes).
struct SamplerParams {
    float temperature;
    float top_p;
    int top_k;
    float repetition_penalty;
    int penalty_window;
    int max_new_tokens;
    unsigned long long seed;
};

struct SamplerSmem {
    double mass[HIST_COPIES][BUCKETS];
    uint32_t count[HIST_COPIES][BUCKETS];
    unsigned long long top[HIST_COPIES][BUCKETS];  // the largest key per digit (the element when count == 1)
    double red_d[WARPS];
    unsigned long long red_k[WARPS];
    int flag;
    unsigned long long found;  // the key, once a chosen digit holds a single element (0: not yet)
    double above;
};

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// model::weights::element_bits.
__device__ __forceinline__ uint64_t element_bits(uint64_t key, uint64_t index) {
    return splitmix64(key + index * 0x9E3779B97F4A7C15ull);
}

// model::sampler::race_bits(seed, step, i) = element_bits(step_bits, i), step_bits = element_bits(splitmix64(seed),
// step) (uniform over the CTA, computed once).
__device__ __forceinline__ uint64_t step_bits(uint64_t seed, uint64_t step) { return element_bits(splitmix64(seed), step); }

// model::sampler::ln_ieee, operation for operation (its doc has the derivation): ln x for a positive normal f32 from
// IEEE ops and fmas only, so that the CPU computes the same bits.
__device__ __forceinline__ float ln_ieee(float x) {
    const uint32_t b = __float_as_uint(x);
    int e = (int)((b >> 23) & 0xFFu) - 127;
    float m = __uint_as_float((b & 0x007FFFFFu) | 0x3F800000u);
    if (m > __uint_as_float(0x3FB504F3u)) {  // sqrt 2
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    const float s = __fdiv_rn(__fsub_rn(m, 1.f), __fadd_rn(m, 1.f));
    const float s2 = __fmul_rn(s, s);
    float p = __fmaf_rn(s2, __uint_as_float(0x3DE38E39u), __uint_as_float(0x3E124925u));  // 1/9, 1/7
    p = __fmaf_rn(s2, p, __uint_as_float(0x3E4CCCCDu));                                      // 1/5
    p = __fmaf_rn(s2, p, __uint_as_float(0x3EAAAAABu));                                      // 1/3
    p = __fmul_rn(p, s2);
    const float two_s = __fadd_rn(s, s);
    const float ln_m = __fmaf_rn(two_s, p, two_s);
    return __fmaf_rn((float)e, __uint_as_float(0x3F317218u), ln_m);  // ln 2
}

// model::sampler::race_key: l / t + g, g = -ln(-ln U), U = ((bits >> 41) + 0.5) 2^-23 in (0, 1) (exact).
__device__ __forceinline__ float race_key(float l, float t, uint64_t bits) {
    const float u = __fmul_rn(__fadd_rn((float)(uint32_t)(bits >> 41), 0.5f), 0x1.0p-23f);
    const float g = -ln_ieee(-ln_ieee(u));
    return __fadd_rn(__fdiv_rn(l, t), g);
}

__device__ __forceinline__ uint32_t ord_f32(float v) {
    uint32_t u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0u;  // -0 -> +0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t make_key(float l, int i) {
    return ((uint64_t)ord_f32(l) << INDEX_BITS) | (uint64_t)(INDEX_MASK - (uint32_t)i);
}
__device__ __forceinline__ int key_index(uint64_t k) { return (int)(INDEX_MASK - (uint32_t)(k & INDEX_MASK)); }

// The penalized logit (apply_repetition_penalty: divide if positive, else multiply; IEEE ops).
__device__ __forceinline__ float penalized(float l, bool seen, float pen) {
    if (!seen) return l;
    return l > 0.f ? __fdiv_rn(l, pen) : __fmul_rn(l, pen);
}

__device__ unsigned long long block_max_u64(unsigned long long v, SamplerSmem& s) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) s.red_k[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long r = 0;
    for (int w = 0; w < WARPS; ++w) r = max(r, s.red_k[w]);
    __syncthreads();
    return r;
}

__device__ double block_sum_f64(double v, SamplerSmem& s) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) s.red_d[threadIdx.x >> 5] = v;
    __syncthreads();
    double r = 0.0;
    for (int w = 0; w < WARPS; ++w) r += s.red_d[w];
    __syncthreads();
    return r;
}

// The row of one sequence: its logits, its seen-token counts and whether the penalty is on.
struct Row {
    const float* logits;
    const uint16_t* counts;
    float pen;
    bool pen_on;
    int V;
    __device__ __forceinline__ float value(int i) const {
        const float l = __ldg(logits + i);
        return pen_on ? penalized(l, counts[i] != 0, pen) : l;
    }
    __device__ __forceinline__ uint64_t key(int i) const { return make_key(value(i), i); }
};

// The first key, in descending order among the elements with key >= lo, at which the running sum of weight(i)
// reaches thr (sum >= thr). 0 (no element has key 0) when the whole set's sum does not. weight(i, key) is called
// only for elements of the set. All threads call this; the result is uniform.
template <typename Weight>
__device__ uint64_t descend(const Row& row, uint64_t lo, double thr, Weight weight, SamplerSmem& s) {
    const int copy = (threadIdx.x >> 5) >> 1;
    uint64_t prefix = 0;
    double above = 0.0;
    for (int level = 0; level < LEVELS; ++level) {
        const int shift = (LEVELS - 1 - level) * DIGIT_BITS;
        for (int i = threadIdx.x; i < HIST_COPIES * BUCKETS; i += THREADS) {
            (&s.mass[0][0])[i] = 0.0;
            (&s.count[0][0])[i] = 0u;
            (&s.top[0][0])[i] = 0ull;
        }
        __syncthreads();
        // Each thread sums its run of equal digits in registers and adds a run to shared memory when the digit
        // changes: at the top levels nearly every element of a row shares one or two digits (sign and exponent),
        // so per-element shared atomics would serialize on one address.
        int run_digit = -1;
        double run_mass = 0.0;
        uint32_t run_count = 0;
        unsigned long long run_top = 0;
        for (int i = threadIdx.x; i < row.V; i += THREADS) {
            const uint64_t k = row.key(i);
            if (k < lo || (level > 0 && (k >> (shift + DIGIT_BITS)) != prefix)) continue;
            const int d = (int)((k >> shift) & (BUCKETS - 1));
            if (d != run_digit) {
                if (run_count != 0) {
                    atomicAdd(&s.mass[copy][run_digit], run_mass);
                    atomicAdd(&s.count[copy][run_digit], run_count);
                    atomicMax(&s.top[copy][run_digit], run_top);
                }
                run_digit = d;
                run_mass = 0.0;
                run_count = 0;
                run_top = 0;
            }
            run_mass += weight(i, k);
            run_count += 1;
            run_top = max(run_top, (unsigned long long)k);
        }
        if (run_count != 0) {
            atomicAdd(&s.mass[copy][run_digit], run_mass);
            atomicAdd(&s.count[copy][run_digit], run_count);
            atomicMax(&s.top[copy][run_digit], run_top);
        }
        __syncthreads();
        if (threadIdx.x < BUCKETS) {  // fold the copies into copy 0, in copy order
            double m = 0.0;
            uint32_t c = 0;
            unsigned long long t = 0;
            for (int h = 0; h < HIST_COPIES; ++h) {
                m += s.mass[h][threadIdx.x];
                c += s.count[h][threadIdx.x];
                t = max(t, s.top[h][threadIdx.x]);
            }
            s.mass[0][threadIdx.x] = m;
            s.count[0][threadIdx.x] = c;
            s.top[0][threadIdx.x] = t;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int chosen = -1, lowest = -1;
            double acc = above, acc_before_lowest = above;
            for (int d = BUCKETS - 1; d >= 0; --d) {
                if (s.count[0][d] == 0) continue;
                const double next = acc + s.mass[0][d];
                if (next >= thr) {
                    chosen = d;
                    break;
                }
                acc_before_lowest = acc;
                lowest = d;
                acc = next;
            }
            if (chosen < 0 && level > 0) {
                // The parent digit crossed, its children's sums (another order) did not: rounding at the 1e-16
                // level. The crossing is then at the parent bucket's last element.
                chosen = lowest;
                acc = acc_before_lowest;
            }
            s.flag = chosen;
            s.above = acc;
            // A chosen digit with one element: that element is the answer (the later levels would only spell
            // out its key).
            s.found = (chosen >= 0 && s.count[0][chosen] == 1) ? s.top[0][chosen] : 0ull;
        }
        __syncthreads();
        const int chosen = s.flag;
        above = s.above;
        const unsigned long long found = s.found;
        __syncthreads();
        if (chosen < 0) return 0;  // level 0: the whole set's sum does not reach thr
        if (found != 0) return found;
        prefix = (prefix << DIGIT_BITS) | (uint64_t)chosen;
    }
    return prefix;
}

}  // namespace

// One sampling step: grid (B), block 1024. logits [B, V] f32; params [B]; stop_ids [n_stop]; state: status,
// steps, hist_len, sampled, next [B] i32, ring [B, ring_cap] i32, counts [B, V] u16; weights [B, V] f64 workspace;
// error [1] (sticky bits).
extern "C" __global__ void __launch_bounds__(THREADS) sampler_step(
    const float* __restrict__ logits, int V, const SamplerParams* __restrict__ params, const int* __restrict__ stop_ids,
    int n_stop, int* __restrict__ status, int* __restrict__ steps, int* __restrict__ hist_len, int* __restrict__ sampled,
    int* __restrict__ next, int* __restrict__ ring, int ring_cap, uint16_t* __restrict__ counts,
    double* __restrict__ weights, uint32_t* __restrict__ error) {
    __shared__ SamplerSmem s;
    const int b = blockIdx.x;
    const SamplerParams p = params[b];
    const int st = status[b];
    const int step = steps[b];
    const bool stop_now = st != RUNNING || step >= p.max_new_tokens;
    if (stop_now) {
        if (threadIdx.x == 0) {
            if (st == RUNNING) status[b] = MAX_TOKENS;
            sampled[b] = -1;
            next[b] = -1;
        }
        return;
    }
    const bool bad = !(p.temperature >= 0.f) || !(p.top_p > 0.f && p.top_p <= 1.f) || p.top_k < 0 ||
                     !(p.repetition_penalty > 0.f) || p.penalty_window < 0 || p.penalty_window > ring_cap;
    if (bad) {
        if (threadIdx.x == 0) {
            status[b] = FAILED;
            sampled[b] = -1;
            next[b] = -1;
            atomicOr(error, ERR_BAD_PARAMS);
        }
        return;
    }
    Row row;
    row.logits = logits + (long)b * V;
    row.counts = counts + (long)b * V;
    row.pen = p.repetition_penalty;
    row.pen_on = p.repetition_penalty != 1.f && p.penalty_window > 0;
    row.V = V;

    // Pass 1: the largest key (argmax, lower id on ties) and the NaN check of the raw logits. A maximum over
    // distinct keys does not depend on the order the elements are visited in, so the row is read as float4 (when
    // V % 4 == 0 the rows are 16-byte aligned), four loads a thread in flight: one CTA streams the 517 KB row of
    // the 129,280-token vocabulary in a few round trips where scalar loads took one per 4 KB.
    unsigned long long kmax = 0;
    int nan_seen = 0;
    constexpr int kLoads = 4;  // float4 loads a thread issues before it uses the first
    const int v4 = V % 4 == 0 ? V / 4 : 0;
    const float4* l4 = reinterpret_cast<const float4*>(row.logits);
    for (int j0 = threadIdx.x; j0 < v4; j0 += kLoads * THREADS) {
        float4 q[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
            const int j = j0 + u * THREADS;
            q[u] = j < v4 ? __ldg(l4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
            const int j = j0 + u * THREADS;
            if (j >= v4) break;
            const float a[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = 4 * j + e;
                nan_seen |= a[e] != a[e];
                const float l = row.pen_on ? penalized(a[e], row.counts[i] != 0, row.pen) : a[e];
                kmax = max(kmax, (unsigned long long)make_key(l, i));
            }
        }
    }
    for (int i = 4 * v4 + threadIdx.x; i < V; i += THREADS) {
        const float l = __ldg(row.logits + i);
        nan_seen |= l != l;
        kmax = max(kmax, (unsigned long long)row.key(i));
    }
    nan_seen = __syncthreads_or(nan_seen);
    if (nan_seen) {
        if (threadIdx.x == 0) {
            status[b] = FAILED;
            sampled[b] = -1;
            next[b] = -1;
            atomicOr(error, ERR_NAN_LOGIT);
        }
        return;
    }
    kmax = block_max_u64(kmax, s);
    int id = key_index(kmax);

    // Greedy, or top-k 1 (a one-element distribution: the CPU returns it without a draw): the argmax.
    if (p.temperature != 0.f && p.top_k != 1) {
        const float T = p.temperature;
        // The kept set: key >= lo. Top-k: the k-th largest key (the element where the count reaches k).
        uint64_t lo = 0;
        if (p.top_k > 0 && p.top_k < V) lo = descend(row, 0, (double)p.top_k, [](int, uint64_t) { return 1.0; }, s);
        if (p.top_p < 1.f) {
            // The nucleus: e_i, Z, q_i = e_i / Z in place, then the key where the running sum of q reaches top_p.
            double* w = weights + (long)b * V;
            const float mx = row.value(id);
            double z = 0.0;
            for (int i = threadIdx.x; i < V; i += THREADS) {
                const float l = row.value(i);
                double e = 0.0;
                if (make_key(l, i) >= lo) {
                    e = exp((double)__fdiv_rn(__fsub_rn(l, mx), T));
                    z += e;
                }
                w[i] = e;
            }
            z = block_sum_f64(z, s);
            for (int i = threadIdx.x; i < V; i += THREADS) w[i] = w[i] / z;
            __syncthreads();
            const uint64_t end = descend(row, lo, (double)p.top_p, [w](int i, uint64_t) { return w[i]; }, s);
            if (end != 0) lo = end;  // none reached: all of the set kept
        }
        // The draw: the largest race key over the kept set (it holds the argmax, so the maximum is some element's).
        const uint64_t sb = step_bits(p.seed, (uint64_t)step);
        unsigned long long best = 0;
        for (int i = threadIdx.x; i < V; i += THREADS) {
            const float l = row.value(i);
            if (make_key(l, i) < lo) continue;
            best = max(best, (unsigned long long)make_key(race_key(l, T, element_bits(sb, (uint64_t)i)), i));
        }
        id = key_index(block_max_u64(best, s));
    }
    __syncthreads();  // every read of counts is done before thread 0 updates them
    if (threadIdx.x != 0) return;
    sampled[b] = id;
    bool is_stop = false;
    for (int j = 0; j < n_stop && j < MAX_STOP; ++j) is_stop |= stop_ids[j] == id;
    if (is_stop) {
        status[b] = STOPPED;
        next[b] = -1;
        return;
    }
    next[b] = id;
    steps[b] = step + 1;
    const int n = hist_len[b];
    const int win = p.penalty_window;
    if (win > 0) {
        int* r = ring + (long)b * ring_cap;
        uint16_t* c = counts + (long)b * V;
        const int slot = n % win;
        if (n >= win) {
            const int old = r[slot];
            if (old >= 0 && old < V) c[old] -= 1;
        }
        r[slot] = id;
        c[id] += 1;
    }
    hist_len[b] = n + 1;
}

// The end of a decode step: each slot's position moves to the token the sampler just wrote to `next`.
// positions[b] >= 0 and next[b] >= 0 (the sequence is still running): positions[b] += 1; next[b] < 0 (the
// sequence stopped or was never admitted): positions[b] = -1, an idle slot every later step skips. One thread
// per slot; graph-safe (B is the capacity).
extern "C" __global__ void __launch_bounds__(128) sampler_advance_positions(int* __restrict__ positions,
                                                                           const int* __restrict__ next, int B) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int p = positions[b];
  positions[b] = (p >= 0 && next[b] >= 0) ? p + 1 : -1;
}
