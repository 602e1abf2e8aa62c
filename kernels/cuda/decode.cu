// Decode attention over a Kitty cache in CUDA C++: the page part of the fused split-KV step
// (`pages_kernel`) and, after it in this file, its tail part (`tail_kernel`: the sink and the window).
//
// One warp is one program: a run of up to PPP page slots of one (sequence, KV head), whose keys and
// values are both packed (a sequence's slots split evenly over the grid's chunks), into one partial
// softmax (max, sum, output) of the layout the Triton tail and combine kernels use
// (`kernels/decode.py`). Warps are independent: no block-wide barrier.
//
// The page format is the library's (`kitty_core.quant`, stored by `kitty_core.page_pool.PagePool`):
// per page and KV head, key dense plane [G/4 rows, D bytes] (byte (i, d): channel d of tokens i,
// i + G/4, i + G/2, i + 3G/4, two bits each, plane P = token quarter P), key high plane [G/4, NB]
// (the high two bits of the NB boosted channels, listed in the boost index), key scale / zero [D]
// fp16; value plane [D/4 rows, G bytes] (byte (j, t): channels j, j + D/4, j + D/2, j + 3D/4 of
// token t), value scale / zero [G] fp16. Here G = D = 128, two-bit values.
//
// Tensor cores, mma.sync with the GQA group's query heads as the narrow operand (n = 8) and page rows
// as the wide one (m = 16):
//   keys    S^T [tokens, heads] = K [tokens, channels] Q^T: A = key codes, B = queries x key scales,
//           m16n8k32 in 8 bits (unsigned codes, signed queries, int32 accumulate);
//   values  O^T [channels, heads] += V^T [channels, tokens] P^T: A = value codes, B = weights,
//           m16n8k16 in fp16 with fp32 accumulate.
// Key dots in 8 bits, as the Triton kernel takes them at this head size: per page and query head,
// q x key scale is rounded to 127 steps of its largest magnitude (the boosted channels' high codes on
// a scale of their own), and the rounding error's part at the mean code, the same for every token of
// the page, goes into the zero term. An 8-bit operand is a code plane masked in place (one LOP3 for
// four codes), and one MMA takes 32 channels. The rounding costs as much as the operands save (Nsight
// Compute counts 0.5-3.4% more instructions than with fp16 dots), but the dependency chains are
// shorter: on one H200 the fused step took 0.2-12% less time at the five shapes of `docs/engine.md`.
// The rounding is done in fp16 pairs: the queries are staged in fp16 (bf16 ones converted, exact
// within fp16's range, which real queries and q x key scale stay far inside), q x key scale is one
// HMUL2 a pair (2^-11 relative, a sixteenth of the 8-bit step) and its rounding one HFMA2 a pair; the
// zero term's dots (q . key zeros, and q . key scales for the rounding error) are fp16 products, exact,
// summed in fp32 on the tensor cores, one m16n8k16 per 16 channels. Against fp32 preparation that is 14% fewer instructions a page
// (`python -m kitty_core.compile --cuda --parts`) and 3-8% less time on one H200.
// A score tile's accumulator is an 8x8 matrix pair in the fragment layout; `movmatrix.trans` turns
// it into the B operand of the value MMA (head = lane / 4), so the weights never leave registers.
// Value codes become operands in registers: a 32-bit word of packed bytes masked in place for plane P
// (one LOP3) is two fp16 subnormals, 2^-24 x 4^P x code (every 16-bit pattern under 0x0400 is
// exactly 2^-24 times itself); bytes 0 and 2 form one register, bytes 1 and 3 (after a shift) the
// other. The reduction axis of every MMA is free to be permuted (both operands agree), and the
// token order is chosen so that the key tile's rows, after the transpose, are the value tile's
// reduction index: a thread's value bytes are then 8 contiguous bytes per token quarter. The factor
// 2^-24 x 4^P comes out with the scaling. Tensor cores multiply subnormal fp16 exactly, and no
// large offset is added and taken away again (as 1024 + code would need), so the accumulators no
// longer lose about 8 bits to it.
// Per-channel key scales fold into the queries, per-token value scales into the weights; the
// softmax runs in base 2 (the scores' scale carries log2 e and the softmax scale; the outputs' 2^24 / 4^P).
// The int8 dots' int32 to fp32 conversion is in the accumulator's start: an MMA that starts from the
// bits of 1.5 x 2^23 ends on the bits of 1.5 x 2^23 + dot (exact: |dot| < 2^22), so that a score is
// one FFMA a plane (the constant's part, x the plane's scale, leaves with the zero term).
// The scores come relative to the running max (it goes into the zero term), so that a weight is one
// ex2; the max is reduced across the warp, and the sums so far rescaled, only on a page where a
// score passed it. The weights' sums and their dots with the value zeros take one more MMA a token
// tile, whose A rows are fp16 ones and the page's zeros, on the fp16 weights the values' MMAs take.
//
// Pipelining: each warp streams its pages through STAGES shared-memory buffers with cp.async
// (page p + STAGES - 1 is in flight while page p is computed); a page's planes, scales and boost
// index are one group. One stage is one buffer whose halves are pipelined: page p + 1's key half
// is copied while page p's values are computed, and its value half while its own keys are: two groups
// a page. The block's smaller footprint (the queries in fp16 and their copy x key scale, 2 KiB each a
// warp, and one page buffer) lets three blocks share an SM instead of two, as the registers do
// (`min_blocks`; `launch_plan` in `kernels/cuda_decode.py` takes one stage for deep grids only).
// Shared-memory rows are XOR-swizzled so that the fragment reads hit distinct banks, and a lane's
// copies of a page share one shared and one global base address a plane, the rest immediate offsets
// of the instructions.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

namespace kitty {
// internal linkage: the launch's per-device state (and every symbol) stays this build's own, also
// where a variant of this file is loaded beside it in one process (GCC makes a template's static
// locals process-wide unique symbols otherwise)
namespace {

constexpr int D = 128;
constexpr int GROUP = 128;  // tokens a page
constexpr int RMAX = 8;  // query heads per KV head the n = 8 tile takes
// a warp's A operand rows of the weights' sums (fp16 ones) and zero dots (a page's value zeros), 16 bytes
// a four-token group: (t0, t0 + 2) twice, (t0 + 1, t0 + 3) twice, one LDS.128 an MMA's A
constexpr int LZ_BYTES = 1024;
constexpr int MAGIC = 0x4b400000;  // 1.5 x 2^23
constexpr float MAGIC_F = 12582912.f;

struct PageArgs {
  const void* q;  // [B, Hq, D] (strides sQb, sQh; channels contiguous), fp16 or bf16
  long long sQb, sQh;
  // per pool: a page's stride (int: one IMAD.WIDE a page id, checked by the caller) and a head's
  const uint8_t* kd; int sKDp; long long sKDh;  // dense plane, [G/4, D] contiguous per page and head
  const uint8_t* kh; int sKHp; long long sKHh;  // high plane, [G/4, NB]
  const uint8_t* kc; int sKCp; long long sKCh;  // boost index, [NB] uint8
  const half* ks; const half* kz; int sKSp; long long sKSh;  // key scale / zero, [D]
  const uint8_t* vl; int sVLp; long long sVLh;  // value plane, [D/4, G]
  const half* vs; const half* vz; int sVSp; long long sVSh;  // value scale / zero, [G]
  const int* kt; const int* vt; long long sKT, sVT;  // page tables [B, width]
  const int* nvp;  // packed value pages of each sequence [B]
  float* m; float* l; void* acc;  // partials: m, l [B, Hq, C]; acc [B, Hq, C, D]
  long long sMb, sMh, sAb, sAh, sAc;
  int batch, hkv, rep, ppp, chunks, chunk0;
  float scaling;  // softmax scale x log2 e
};

template <int NB>
struct Layout {
  static constexpr int KD = 0, VL = 4096, KS = 8192, KZ = KS + 256, VS = 8704, VZ = VS + 256, KH = 9216;
  static constexpr int KC = KH + NB * 32;
  static constexpr int BYTES = ((KC + NB + 127) / 128) * 128;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// a shared-memory store and load that only each other read: volatile, they keep their order (and the
// __syncwarp between them) without a "memory" clobber, which would hold back every other load
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t x) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x));
}
__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t x;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(x) : "r"(addr));
  return x;
}

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// mma.m16n8k32, unsigned 8-bit A (codes) x signed 8-bit B (rounded queries), int32 accumulate
__device__ __forceinline__ void mma_u8s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// 1 / x on the SFU alone (rcp.approx.ftz: within an ulp; 1 / 0 is +inf), without the range checks of
// __fdividef
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// a register whose value does not matter (an operand of rows whose sums are not read): no instruction
__device__ __forceinline__ uint32_t unset() {
  uint32_t x;
  asm volatile("" : "=r"(x));
  return x;
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// the fp16 pairs x and y multiplied (HMUL2), as bits
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t x, uint32_t y) {
  return half2_bits(__hmul2(*reinterpret_cast<const __half2*>(&x), *reinterpret_cast<const __half2*>(&y)));
}

// Plane p of a word of packed bytes (or of it shifted right 8): bytes 0 and 2 -> the fp16 subnormals
// 2^-24 x 4^p x code (one LOP3). p is a constant once the loops are unrolled.
__device__ __forceinline__ uint32_t plane_rt(uint32_t w, int p) { return w & (0x00030003u << (2 * p)); }

// 2^24 / 4^p: what turns plane p's products back into code x operand
__device__ __forceinline__ float plane_scale(int p) { return 16777216.f / float(1 << (2 * p)); }

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<half>(half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ half from_f<half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Byte row of the key planes that holds (token quarter P's) tile row g + 8s of half jh. With g =
// 2u + e it is 8u + 4jh + 2e + s: after the transpose, value reduction index 2u + e + 8s of k-tile
// (P, jh) is token 32P + 8u + 4jh + 2e + s, so a thread's value bytes are [32P + 8u, 32P + 8u + 8).
__device__ __forceinline__ int key_row(int g, int jh, int s) { return 8 * (g >> 1) + 4 * jh + 2 * (g & 1) + s; }

// swizzles: 16-byte chunk c of key dense row r; 8-byte unit u of value row r
__device__ __forceinline__ int kd_off(int r, int c) { return r * 128 + ((c ^ (((r >> 1) & 1) << 2)) << 4); }
__device__ __forceinline__ int vl_off(int r, int u) { return r * 128 + ((u ^ ((r & 3) << 2)) << 3); }

// one 16-byte copy to shared address dst + OFF from src + OFF: both offsets are immediates of the
// instruction, so a page's copies share two base addresses and cost no address arithmetic
template <int OFF>
__device__ __forceinline__ void cp16_at(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;\n" ::"r"(dst), "l"(src), "n"(OFF));
}

// copies k = 0, 1, ... of 16 bytes at offset 512 k (32 lanes x 16 bytes apart)
template <int... K>
__device__ __forceinline__ void cp_rows(uint32_t dst, const uint8_t* src, std::integer_sequence<int, K...>) {
  (cp16_at<512 * K>(dst, src), ...);
}

// a page's key half: dense plane, scales and zeros, high plane and boost index
template <int NB>
__device__ __forceinline__ void issue_keys(uint8_t* st, const PageArgs& a, int kp, int h, int lane) {
  using L = Layout<NB>;
  const uint32_t base = smem_addr(st);
  // lane l copies bytes 16 l + 512 k of the plane (32 rows of 128 bytes): row r = l / 8 + 4 k, 16-byte
  // chunk l % 8, and the swizzle depends on r's low two bits only, which k leaves alone
  cp_rows(base + L::KD + kd_off(lane >> 3, lane & 7), a.kd + (long long)kp * a.sKDp + h * a.sKDh + lane * 16,
          std::make_integer_sequence<int, 8>{});
  // scales (lanes 0-15) and zeros (16-31), 256 bytes each: KZ = KS + 256
  const uint8_t* sz = reinterpret_cast<const uint8_t*>((lane < 16 ? a.ks : a.kz) + (long long)kp * a.sKSp + h * a.sKSh);
  cp16_at<0>(base + L::KS + lane * 16, sz + (lane & 15) * 16);
  if constexpr (NB > 0) {
    cp_rows(base + L::KH + lane * 16, a.kh + (long long)kp * a.sKHp + h * a.sKHh + lane * 16,
            std::make_integer_sequence<int, NB / 16>{});
    const uint8_t* kc = a.kc + (long long)kp * a.sKCp + h * a.sKCh;
    if (lane < NB / 16) cp16(st + L::KC + lane * 16, kc + lane * 16);
  }
}

// a page's value half: the plane, scales and zeros
template <int NB>
__device__ __forceinline__ void issue_values(uint8_t* st, const PageArgs& a, int vp, int h, int lane) {
  using L = Layout<NB>;
  const uint32_t base = smem_addr(st);
  // 16 chunks of 8-byte units (2u, 2u + 1) a row; the swizzle keeps unit pairs together
  const int r = lane >> 3, c = lane & 7;
  cp_rows(base + L::VL + vl_off(r, 2 * c), a.vl + (long long)vp * a.sVLp + h * a.sVLh + lane * 16,
          std::make_integer_sequence<int, 8>{});
  const uint8_t* sz = reinterpret_cast<const uint8_t*>((lane < 16 ? a.vs : a.vz) + (long long)vp * a.sVSp + h * a.sVSh);
  cp16_at<0>(base + L::VS + lane * 16, sz + (lane & 15) * 16);  // VZ = VS + 256
}

// a whole page: both halves, one group (at two stages)
template <int NB>
__device__ __forceinline__ void issue_page(uint8_t* st, const PageArgs& a, int kp, int vp, int h, int lane) {
  issue_keys<NB>(st, a, kp, h, lane);
  issue_values<NB>(st, a, vp, h, lane);
}

// blocks an SM the registers must allow: three at one stage (168 registers a thread), two at two
// stages (shared memory's limit). Shared memory would hold four blocks at one stage without boosted
// channels (three with them: 59-65 KiB a block with the gather's copy), but at 128 registers the
// one-stage builds spill (21-70 memory operations, 4-23 a page; at 168: 0-20 and 0-3)
// and, on one H200 at 25% boost, took 5-6% more time on the deep grids of `docs/engine.md` (the
// same at boost 0)
template <int STAGES> constexpr int min_blocks() { return STAGES == 1 ? 3 : 2; }

// With boosted channels, a warp keeps a copy of its queries x the page's key scales (fp16, RMAX rows of
// D), from which the boosted channels are gathered: a row is 256 bytes at a 256-byte aligned address,
// so that a channel's address is its row's with the low byte replaced by 2 x channel (one PRMT)
template <int NB> constexpr int QX_BYTES = NB > 0 ? RMAX * D * 2 : 0;
constexpr int ALIGN = 256;
__host__ __device__ constexpr int round_up(int n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

// a block's dynamic shared memory from its first ALIGN-aligned byte, where the gather needs it (the
// launch adds ALIGN bytes); said so to the compiler, which then merges loads and folds offsets as it
// does on the declared 128-byte alignment
template <int NB>
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* smem) {
  if constexpr (NB == 0) return smem;
  return static_cast<uint8_t*>(
      __builtin_assume_aligned(smem + ((ALIGN - (smem_addr(smem) & (ALIGN - 1))) & (ALIGN - 1)), ALIGN));
}

// a warp's shared memory: the copy above, the n = 8 tile's query rows (2 bytes each; rows past the
// group's heads zero), the rows of ones and value zeros, and its stages
template <int NB, int STAGES>
__host__ __device__ constexpr int warp_bytes() {
  return round_up(QX_BYTES<NB> + RMAX * D * 2 + LZ_BYTES + STAGES * Layout<NB>::BYTES);
}

// The scores of a packed key page staged at st (`issue_keys`) against a group's queries qs (fp16,
// [RMAX, D] in shared memory): s[P][jh] is the score tile (token quarter P, half jh) of 16 tokens x
// 8 heads in the accumulator layout, rows g, g + 8 tokens 32 P + key_row(g, jh, 0 / 1), columns heads
// 2t, 2t + 1; base 2, `scaling` (softmax scale x log2 e) and the zero term included. Shared by the
// page kernel and the tail kernel (a window slot whose keys are packed and values are not).
template <int NB>
__device__ __forceinline__ void page_key_scores(float (&s)[4][2][4], const uint8_t* st, const half* qs, half* qx, int g,
                                                int t, float scaling, float off0 = 0.f, float off1 = 0.f) {
  using L = Layout<NB>;
  // ---- the queries for int8 key dots: x the page's key scales, rounded to 8 bits per head (sigma = max / 127) ----
  // Thread (g, t) holds head g's channels c0 .. c0 + 15 for c0 = 16 t and 64 + 16 t as 16 fp16 pairs:
  // pair k is channels 64 (k / 8) + 16 t + 2 (k % 8) + {0, 1}, and code word w (pairs 2w, 2w + 1) the
  // same four channels as its dense-plane word w. k-tile kk of mma.m16n8k32 takes words 2 kk (a0,
  // a1; b0) and 2 kk + 1 (a2, a3; b1): A and B agree on the reduction order, which is all an MMA needs.
  uint32_t qw[16], sw[16], aw[16];
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const int c = 64 * v + 16 * t;
    const uint4 q0 = *reinterpret_cast<const uint4*>(qs + g * D + c);
    const uint4 q1 = *reinterpret_cast<const uint4*>(qs + g * D + c + 8);
    const uint4 s0 = *reinterpret_cast<const uint4*>(st + L::KS + 2 * c);
    const uint4 s1 = *reinterpret_cast<const uint4*>(st + L::KS + 2 * c + 16);
    // the A operand of the zero and scale dots: row 0 the key zeros, row 1 the key scales (rows 2-7
    // repeat them, rows 8-15 are unset, and their sums are not read)
    const uint8_t* ar = st + ((g & 1) ? L::KS : L::KZ) + 2 * c;
    const uint4 a0 = *reinterpret_cast<const uint4*>(ar);
    const uint4 a1 = *reinterpret_cast<const uint4*>(ar + 16);
    const uint32_t qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    const uint32_t sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    const uint32_t av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) { qw[8 * v + k] = qv[k]; sw[8 * v + k] = sv[k]; aw[8 * v + k] = av[k]; }
  }
  // the zero term's dots sum_d q_d z_d and sum_d q_d s_d (exact fp16 products, summed in fp32), one
  // m16n8k16 per 16 channels: thread (0, t) gets the first for heads 2t, 2t + 1, thread (1, t) the second
  float dots[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j) mma(dots, aw[2 * j], unset(), aw[2 * j + 1], unset(), qw[2 * j], qw[2 * j + 1]);
  // q x key scale in fp16 pairs (2^-11 relative: 1/16 of the 8-bit step), and its largest magnitude
  __half2 x2[16];
  __half2 amax2 = __float2half2_rn(0.f);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    x2[k] = __hmul2(*reinterpret_cast<const __half2*>(&qw[k]), *reinterpret_cast<const __half2*>(&sw[k]));
    amax2 = __hmax2(amax2, __habs2(x2[k]));
  }
  if constexpr (NB > 0) {  // the products to row g of the warp's copy, for the boosted channels' gather
    const uint32_t xr = smem_addr(qx + g * D + 16 * t);
#pragma unroll
    for (int k = 0; k < 16; ++k) sts32(xr + 128 * (k / 8) + 4 * (k % 8), half2_bits(x2[k]));
    __syncwarp();
  }
  float amax = fmaxf(__low2float(amax2), __high2float(amax2));
  amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, 2));
  // x / sigma rounded to nearest (even) in one HFMA2 a pair: 1536 + x / sigma lies in [1024, 2048), where
  // fp16's step is 1, and its low mantissa byte is the rounded value in two's complement. sigma is
  // 1 / (the fp16 reciprocal), so that the codes' scale is the one they were rounded with
  // (the approximate divisions, MUFU.RCP: IEEE division's slow path would cost 20 instructions each)
  // (the reciprocal held to fp16's largest, 65504: below a largest magnitude of 127 / 65504 the
  // queries keep fewer than 127 steps, each of 1 / 65504)
  // (rows past the group's heads are zero: their reciprocal is held to 65504 and their codes are 0)
  const __half inv = __float2half_rn(fminf(127.f * rcp_ftz(amax), 65504.f));
  const float sigma = rcp_ftz(__half2float(inv));
  const __half2 inv2 = __half2half2(inv), magic = __float2half2_rn(1536.f);
  uint32_t kb8[8];
  int rsum = 0;  // the thread's rounded queries, summed: with the scale dot, the rounding's error at the codes' mean
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const __half2 lo = __hfma2(x2[2 * w], inv2, magic), hi = __hfma2(x2[2 * w + 1], inv2, magic);
    kb8[w] = __byte_perm(half2_bits(lo), half2_bits(hi), 0x6420);
    rsum = __dp4a(int(kb8[w]), 0x01010101, rsum);
  }
  // a score's rounding error is sum_d e_d c_d; its part at the mean code 1.5 is the same for every
  // token: 1.5 (sigma sum_d r_d - sum_d q_d s_d), the first sum here, the second from the MMA
  float rerr = 1.5f * float(rsum) * sigma;
  constexpr int NBW = NB / 16;  // a thread's words of the high plane a row (NB / 4 bytes)
  uint32_t hb8[NBW > 0 ? NBW : 1];
  float bsigma = 0.f;  // the boosted queries' step
  if constexpr (NB > 0) {
    // the boosted channels' high codes, on a scale of their own: a boosted channel's key scale is
    // about a fifth of a 2-bit one's, so on the dense scale its queries would keep few levels. The
    // thread's NB / 4 channels (its high-plane bytes of a row) are gathered from the warp's copy of q x
    // key scale two at a time into fp16 pairs and rounded as the dense ones are. Their sum is taken of
    // the products x 1/8 (exact, and one HFMA2 a pair as an HADD2 would be): up to 2 x NBW = 8 of them
    // a half, each below fp16's largest, cannot overflow it, where a plain sum of large keys' products
    // could
    __half2 xb[2 * NBW];
    __half2 bmax2 = __float2half2_rn(0.f), bsum2 = __float2half2_rn(0.f);
    const __half2 eighth = __float2half2_rn(0.125f);
    static_assert(2 * NBW <= 8, "the boosted sum x 1/8 holds at most 8 products a half");
    const uint32_t row = smem_addr(qx + g * D);
#pragma unroll
    for (int w = 0; w < NBW; ++w) {
      // four channels' byte offsets 2c in the row (c < D = 128: no carry into the next byte)
      const uint32_t off = *reinterpret_cast<const uint32_t*>(st + L::KC + t * (NB / 4) + 4 * w) << 1;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t lo = lds16(__byte_perm(off, row, 0x7650 | (2 * j))),
                       hi = lds16(__byte_perm(off, row, 0x7650 | (2 * j + 1)));
        const uint32_t bits = __byte_perm(lo, hi, 0x5410);
        const __half2 x = *reinterpret_cast<const __half2*>(&bits);
        xb[2 * w + j] = x;
        bmax2 = __hmax2(bmax2, __habs2(x));
        bsum2 = __hfma2(x, eighth, bsum2);
      }
    }
    float bamax = fmaxf(__low2float(bmax2), __high2float(bmax2));
    bamax = fmaxf(bamax, __shfl_xor_sync(~0u, bamax, 1));
    bamax = fmaxf(bamax, __shfl_xor_sync(~0u, bamax, 2));
    const __half binv = __float2half_rn(fminf(127.f * rcp_ftz(bamax), 65504.f));
    bsigma = rcp_ftz(__half2float(binv));
    const __half2 binv2 = __half2half2(binv);
    int brsum = 0;
#pragma unroll
    for (int w = 0; w < NBW; ++w) {
      const __half2 lo = __hfma2(xb[2 * w], binv2, magic), hi = __hfma2(xb[2 * w + 1], binv2, magic);
      hb8[w] = __byte_perm(half2_bits(lo), half2_bits(hi), 0x6420);
      brsum = __dp4a(int(hb8[w]), 0x01010101, brsum);
    }
    // high codes weigh 4, mean 1.5
    rerr += 6.f * (float(brsum) * bsigma - 8.f * (__low2float(bsum2) + __high2float(bsum2)));
  }
  rerr += __shfl_xor_sync(~0u, rerr, 1);
  rerr += __shfl_xor_sync(~0u, rerr, 2);
  // the zero term of heads 2t and 2t + 1 (this thread's score columns)
  const float e0 = __shfl_sync(~0u, rerr, 8 * t), e1 = __shfl_sync(~0u, rerr, 8 * t + 4);
  const float qz0 = __shfl_sync(~0u, dots[0], t), qz1 = __shfl_sync(~0u, dots[1], t);
  const float qsc0 = __shfl_sync(~0u, dots[0], 4 + t), qsc1 = __shfl_sync(~0u, dots[1], 4 + t);
  const float zero0 = (qz0 + 1.5f * qsc0 - e0) * scaling - off0, zero1 = (qz1 + 1.5f * qsc1 - e1) * scaling - off1;
  const float sig = sigma * scaling;
  const float sig0 = __shfl_sync(~0u, sig, 8 * t), sig1 = __shfl_sync(~0u, sig, 8 * t + 4);
  const float bsig = bsigma * 4.f * scaling;  // x 4: the high codes' weight
  const float bsig0 = __shfl_sync(~0u, bsig, 8 * t), bsig1 = __shfl_sync(~0u, bsig, 8 * t + 4);

  // ---- scores: 8 tiles (token quarter P, half jh) of 16 tokens x 8 heads, int32 then scaled ----
#pragma unroll
  for (int jh = 0; jh < 2; ++jh) {
    uint32_t wd[2][8];
#pragma unroll
    for (int ss = 0; ss < 2; ++ss) {
      const int r = key_row(g, jh, ss);
      const uint4 x0 = *reinterpret_cast<const uint4*>(st + L::KD + kd_off(r, t));
      const uint4 x1 = *reinterpret_cast<const uint4*>(st + L::KD + kd_off(r, 4 + t));
      wd[ss][0] = x0.x; wd[ss][1] = x0.y; wd[ss][2] = x0.z; wd[ss][3] = x0.w;
      wd[ss][4] = x1.x; wd[ss][5] = x1.y; wd[ss][6] = x1.z; wd[ss][7] = x1.w;
    }
    uint32_t hw[2][NBW > 0 ? NBW : 1];
    if constexpr (NB > 0) {
#pragma unroll
      for (int ss = 0; ss < 2; ++ss) {
        const int r = key_row(g, jh, ss);
#pragma unroll
        for (int w = 0; w < NBW; ++w)
          hw[ss][w] = *reinterpret_cast<const uint32_t*>(st + L::KH + r * NB + t * (NB / 4) + 4 * w);
      }
    }
#pragma unroll
    for (int P = 0; P < 4; ++P) {
      const uint32_t m8 = 0x03030303u << (2 * P);  // plane P of four bytes: code x 4^P, unsigned 8-bit
      int acc8[4] = {MAGIC, MAGIC, MAGIC, MAGIC};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        mma_u8s8(acc8, wd[0][2 * kk] & m8, wd[1][2 * kk] & m8, wd[0][2 * kk + 1] & m8, wd[1][2 * kk + 1] & m8,
                 kb8[2 * kk], kb8[2 * kk + 1]);
      int hacc[4] = {MAGIC, MAGIC, MAGIC, MAGIC};
      if constexpr (NB > 0) {
#pragma unroll
        for (int kk = 0; kk < (NBW + 1) / 2; ++kk) {
          const uint32_t a0 = hw[0][2 * kk] & m8, a1 = hw[1][2 * kk] & m8;
          const uint32_t a2 = 2 * kk + 1 < NBW ? hw[0][2 * kk + 1] & m8 : 0u;
          const uint32_t a3 = 2 * kk + 1 < NBW ? hw[1][2 * kk + 1] & m8 : 0u;
          const uint32_t b1 = 2 * kk + 1 < NBW ? hb8[2 * kk + 1] : 0u;
          mma_u8s8(hacc, a0, a1, a2, a3, hb8[2 * kk], b1);
        }
      }
      const float f0 = sig0 / float(1 << (2 * P)), f1 = sig1 / float(1 << (2 * P));
      const float b0 = NB > 0 ? bsig0 / float(1 << (2 * P)) : 0.f, b1 = NB > 0 ? bsig1 / float(1 << (2 * P)) : 0.f;
      const float k0 = fmaf(-MAGIC_F, f0 + b0, zero0), k1 = fmaf(-MAGIC_F, f1 + b1, zero1);
      float* c = s[P][jh];
      c[0] = fmaf(__int_as_float(acc8[0]), f0, k0); c[1] = fmaf(__int_as_float(acc8[1]), f1, k1);
      c[2] = fmaf(__int_as_float(acc8[2]), f0, k0); c[3] = fmaf(__int_as_float(acc8[3]), f1, k1);
      if constexpr (NB > 0) {
        c[0] = fmaf(__int_as_float(hacc[0]), b0, c[0]); c[1] = fmaf(__int_as_float(hacc[1]), b1, c[1]);
        c[2] = fmaf(__int_as_float(hacc[2]), b0, c[2]); c[3] = fmaf(__int_as_float(hacc[3]), b1, c[3]);
      }
    }
  }

}

template <typename T, int NB, int STAGES>
__global__ void __launch_bounds__(128, min_blocks<STAGES>()) pages_kernel(const PageArgs a) {
  static_assert(STAGES == 1 || STAGES == 2, "the waits below count the groups of one or two stages");
  using L = Layout<NB>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
#if __CUDA_ARCH__ >= 900
  // the combine, a programmatic dependent, may be scheduled once every block has started; it waits
  // for this grid's writes before it reads them (`griddepcontrol.wait`)
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const int item = blockIdx.x * (blockDim.x >> 5) + warp;
  if (item >= a.batch * a.hkv * a.chunks) return;
  const int chunk = item % a.chunks;
  const int h = (item / a.chunks) % a.hkv;
  const int b = item / (a.chunks * a.hkv);
  half* qx = reinterpret_cast<half*>(aligned_smem<NB>(smem) + warp * warp_bytes<NB, STAGES>());
  half* qs = qx + QX_BYTES<NB> / 2;
  uint8_t* ones = reinterpret_cast<uint8_t*>(qs + RMAX * D);
  uint8_t* zq = ones + LZ_BYTES / 2;
  uint8_t* stages = ones + LZ_BYTES;

  // the sequence's live slots spread evenly over the grid's chunks, at most ppp each (the grid has
  // ceil(slots / ppp) chunks for the longest run): a grid sized for the cache's capacity (one CUDA
  // graph for every length) keeps all its chunks busy at any length, not the first few
  const int n_vp = a.nvp[b];
  const int per = (n_vp + a.chunks - 1) / a.chunks;
  const int first = chunk * per;
  const int count = min(n_vp - first, per);
  const long long mrow = b * a.sMb + (long long)(h * a.rep) * a.sMh + a.chunk0 + chunk;
  if (count <= 0) {  // a dead program: its max alone, -inf, tells the combine to skip it
    if (lane < a.rep) a.m[mrow + lane * a.sMh] = __int_as_float(0xff800000);
    return;
  }
  int kid = 0, vid = 0;
  if (lane < count) {
    kid = a.kt[b * a.sKT + first + lane];
    vid = a.vt[b * a.sVT + first + lane];
  }
  // first pages in flight before the queries are read: at one stage, the first page's key half and
  // value half as two groups
  if constexpr (STAGES == 1) {
    issue_keys<NB>(stages, a, __shfl_sync(~0u, kid, 0), h, lane);
    cp_commit();
    issue_values<NB>(stages, a, __shfl_sync(~0u, vid, 0), h, lane);
    cp_commit();
  } else {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      const int kp = __shfl_sync(~0u, kid, s), vp = __shfl_sync(~0u, vid, s);
      if (s < count) issue_page<NB>(stages + s * L::BYTES, a, kp, vp, h, lane);
      cp_commit();
    }
  }
  const T* q = reinterpret_cast<const T*>(a.q) + b * a.sQb + (long long)(h * a.rep) * a.sQh;
  for (int i = lane; i < RMAX * D; i += 32) {
    const int r = i / D;
    qs[i] = r < a.rep ? __float2half_rn(to_f<T>(q[r * a.sQh + i % D])) : __float2half_rn(0.f);
  }
  reinterpret_cast<uint4*>(ones)[lane] = make_uint4(0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u);
  __syncwarp();

  float acc[4][2][4];  // [channel plane P'][half jj][fragment]: O^T rows P'*32 + jj*16 + g (+8), heads 2t, 2t+1
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;
  float m0 = 0.f, m1 = 0.f;  // the running max (base 2), the scores' origin from the second page on
  // row 0 (lanes g = 0): the weights' sums; row 1 (g = 1): their dots with the value zeros
  float lz[4] = {0.f, 0.f, 0.f, 0.f};

  for (int i = 0; i < count; ++i) {
    // ---- page copies: page i + STAGES - 1 put in flight, page i waited for (at one stage: its key
    // half; its value half may still be in flight) ----
    if constexpr (STAGES > 1) {
      const int nxt = i + STAGES - 1;
      const int kn = __shfl_sync(~0u, kid, nxt & 31), vn = __shfl_sync(~0u, vid, nxt & 31);
      if (nxt < count) issue_page<NB>(stages + (nxt % STAGES) * L::BYTES, a, kn, vn, h, lane);
      cp_commit();
    }
    cp_wait<1>();  // at two stages: all but the page just issued; at one: all but page i's value half
    __syncwarp();
    uint8_t* const st = stages + (i % STAGES) * L::BYTES;

    // ---- key scores: the queries x the page's key scales rounded to 8 bits, int8 dots (`page_key_scores`) ----
    float s[4][2][4];
    page_key_scores<NB>(s, st, qs, qx, g, t, a.scaling, m0, m1);

    // ---- page copies, at one stage: page i + 1's key half into the buffer, page i's value half waited for ----
    if constexpr (STAGES == 1) {
      __syncwarp();  // every lane is done with the key half
      if (i + 1 < count) issue_keys<NB>(stages, a, __shfl_sync(~0u, kid, (i + 1) & 31), h, lane);
      cp_commit();
      cp_wait<1>();
      __syncwarp();
    }

    // ---- online softmax (base 2) per head column: the scores come relative to the running max ----
    float x0 = fmaxf(s[0][0][0], s[0][0][2]), x1 = fmaxf(s[0][0][1], s[0][0][3]);
#pragma unroll
    for (int P = 0; P < 4; ++P)
#pragma unroll
      for (int jh = P == 0 ? 1 : 0; jh < 2; ++jh) {
        x0 = fmaxf(x0, fmaxf(s[P][jh][0], s[P][jh][2]));
        x1 = fmaxf(x1, fmaxf(s[P][jh][1], s[P][jh][3]));
      }
    // the max moves (and what was summed is rescaled) on the first page and where a score passed it
    // (a warp-wide vote: the branch is uniform), after a sequence's first pages seldom
    if (i == 0 || __any_sync(~0u, fmaxf(x0, x1) > 0.f)) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(~0u, x0, o));
        x1 = fmaxf(x1, __shfl_xor_sync(~0u, x1, o));
      }
      const float d0 = i == 0 ? x0 : fmaxf(x0, 0.f), d1 = i == 0 ? x1 : fmaxf(x1, 0.f);
      const float al0 = i == 0 ? 0.f : exp2_ftz(-d0), al1 = i == 0 ? 0.f : exp2_ftz(-d1);
      m0 += d0; m1 += d1;
      lz[0] *= al0; lz[1] *= al1;
#pragma unroll
      for (int P = 0; P < 4; ++P)
#pragma unroll
        for (int jh = 0; jh < 2; ++jh) {
          s[P][jh][0] -= d0; s[P][jh][1] -= d1; s[P][jh][2] -= d0; s[P][jh][3] -= d1;
        }
#pragma unroll
      for (int i2 = 0; i2 < 4; ++i2)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          acc[i2][j][0] *= al0; acc[i2][j][1] *= al1; acc[i2][j][2] *= al0; acc[i2][j][3] *= al1;
        }
    }

    // ---- values: per token tile (P, jh), the weights as the B operand of 8 channel tiles ----
    // each group of four tokens' value scales and zeros put in the order of the B operand's pairs,
    // (t0, t0 + 2), (t0 + 1, t0 + 3), in place
    {
      uint2* vsz = reinterpret_cast<uint2*>(st + L::VS);  // VZ = VS + 256
      const uint2 x = vsz[lane], y = vsz[lane + 32];
      vsz[lane] = make_uint2(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.x, x.y, 0x7632));
      const uint32_t z0 = __byte_perm(y.x, y.y, 0x5410), z1 = __byte_perm(y.x, y.y, 0x7632);
      reinterpret_cast<uint4*>(zq)[lane] = make_uint4(z0, z0, z1, z1);
      __syncwarp();
    }
    const uint8_t* lzrow = g == 0 ? ones : zq;  // the A operand of the weights' sums (row 0) and zero dots (row 1)
#pragma unroll
    for (int P = 0; P < 4; ++P) {
      uint32_t vw[2][2][2];  // [jj][ss][jh]
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int ss = 0; ss < 2; ++ss) {
          const int r = jj * 16 + g + 8 * ss;
          const uint2 x = *reinterpret_cast<const uint2*>(st + L::VL + vl_off(r, 4 * P + t));
          vw[jj][ss][0] = x.x; vw[jj][ss][1] = x.y;
        }
#pragma unroll
      for (int jh = 0; jh < 2; ++jh) {
        // after the transpose this thread holds the weights of tokens (t0, t0 + 2) in b0 and (t0 + 1,
        // t0 + 3) in b1, t0 = 32 P + 8 t + 4 jh: four-token group 8 P + 2 t + jh
        const int grp = 8 * P + 2 * t + jh;
        const uint2 vsc = *reinterpret_cast<const uint2*>(st + L::VS + 8 * grp);
        const uint4 lza = *reinterpret_cast<const uint4*>(lzrow + 16 * grp);
        const float* c = s[P][jh];
        const float p0 = exp2_ftz(c[0]), p1 = exp2_ftz(c[1]), p2 = exp2_ftz(c[2]), p3 = exp2_ftz(c[3]);
        const uint32_t u0 = transpose8x8(half2_bits(__floats2half2_rn(p0, p1)));
        const uint32_t u1 = transpose8x8(half2_bits(__floats2half2_rn(p2, p3)));
        // the weights' sums and zero dots: rows 0 and 1 of one MMA (rows 2-15 are not read)
        mma(lz, lza.x, lza.y, lza.z, lza.w, u0, u1);
        // the weights x their token's value scale, in fp16 (the B operand's type): one HMUL2 a pair
        const uint32_t b0 = hmul2_bits(u0, vsc.x), b1 = hmul2_bits(u1, vsc.y);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const uint32_t w0 = vw[jj][0][jh], w1 = vw[jj][1][jh];
          const uint32_t w0s = w0 >> 8, w1s = w1 >> 8;
#pragma unroll
          for (int Q = 0; Q < 4; ++Q)
            mma(acc[Q][jj], plane_rt(w0, Q), plane_rt(w1, Q), plane_rt(w0s, Q),
                plane_rt(w1s, Q), b0, b1);
        }
      }
    }
    __syncwarp();  // every lane is done with this stage before a later page's copy lands in it

    // ---- page copies, at one stage: page i + 1's value half into the buffer ----
    if constexpr (STAGES == 1) {
      if (i + 1 < count) issue_values<NB>(stages, a, __shfl_sync(~0u, vid, (i + 1) & 31), h, lane);
      cp_commit();
    }
  }
  cp_wait<0>();

  // ---- the partial: max (natural log), sum, output = weighted values / sum ----
  const float l0 = __shfl_sync(~0u, lz[0], t), l1 = __shfl_sync(~0u, lz[1], t);
  const float z0 = __shfl_sync(~0u, lz[0], 4 + t), z1 = __shfl_sync(~0u, lz[1], 4 + t);
  const int h0 = 2 * t, h1 = 2 * t + 1;
  const float r0 = 1.f / l0, r1 = 1.f / l1;
  T* out = reinterpret_cast<T*>(a.acc) + b * a.sAb + (long long)(h * a.rep) * a.sAh + (a.chunk0 + chunk) * a.sAc;
#pragma unroll
  for (int Q = 0; Q < 4; ++Q) {
    const float f = plane_scale(Q);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int ch = Q * 32 + jj * 16 + g;
      const float* c = acc[Q][jj];
      if (h0 < a.rep) {
        out[h0 * a.sAh + ch] = from_f<T>((c[0] * f + z0) * r0);
        out[h0 * a.sAh + ch + 8] = from_f<T>((c[2] * f + z0) * r0);
      }
      if (h1 < a.rep) {
        out[h1 * a.sAh + ch] = from_f<T>((c[1] * f + z1) * r1);
        out[h1 * a.sAh + ch + 8] = from_f<T>((c[3] * f + z1) * r1);
      }
    }
  }
  if (g == 0) {
    const float LN2 = 0.6931471805599453f;
    if (h0 < a.rep) { a.m[mrow + h0 * a.sMh] = m0 * LN2; a.l[mrow + h0 * a.sMh] = l0; }
    if (h1 < a.rep) { a.m[mrow + h1 * a.sMh] = m1 * LN2; a.l[mrow + h1 * a.sMh] = l1; }
  }
}

// Launch KERN over `items` one-warp programs, `warps` a block, each warp with `per_warp` bytes of dynamic
// shared memory. The shared-memory limit is an attribute of the kernel in one device's context: set
// once per device (a model split over GPUs launches on each), for the most warps a block takes (4),
// before any capture.
template <auto KERN, typename Args>
int launch_warps(const Args& a, long long items, int per_warp, int warps, cudaStream_t stream) {
  constexpr int DEVICES = 64;
  static bool sized[DEVICES] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  if (dev >= DEVICES) return (int)cudaErrorInvalidDevice;
  if (!sized[dev]) {
    e = cudaFuncSetAttribute(KERN, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * per_warp + ALIGN);
    if (e != cudaSuccess) return (int)e;
    sized[dev] = true;
  }
  const int blocks = (int)((items + warps - 1) / warps);
  if (blocks == 0) return 0;
  KERN<<<blocks, warps * 32, (size_t)warps * per_warp + ALIGN, stream>>>(a);
  return (int)cudaGetLastError();
}

template <typename T, int NB, int STAGES>
int launch_t(const PageArgs& a, int warps, cudaStream_t stream) {
  return launch_warps<pages_kernel<T, NB, STAGES>>(a, (long long)a.batch * a.hkv * a.chunks, warp_bytes<NB, STAGES>(),
                                                   warps, stream);
}


// ---------------------------------------------------------------------------------------------------
// The tail: the sink (program 0 of a (sequence, KV head)) and the window slots (programs 1 .. NT), whose
// values are in the value window and whose keys are in the key q-buffer or, for slots packed already,
// in a key page. One warp is one program, as above, and the same fragments: score tiles of 16 tokens x
// 8 heads (S^T, the heads as the narrow operand), turned into the value MMA's B operand by
// `movmatrix.trans`; O^T [channels, heads] accumulated on the value rows as the A operand. The tokens of
// a tile are those of a page's tile (`key_row`), so that a packed key page's scores (`page_key_scores`)
// and the buffers' follow one path to the values.
//
// The buffers store tokens [D] contiguous, in the model's dtype or as int8 codes with an fp32 scale a
// token (`tail_bits=8`). Both become operands in registers, loaded straight from global memory 16
// bytes a lane, with no shared-memory round trip:
//   keys    A = key rows [tokens, channels]: a lane loads channels 16t .. 16t + 15 and 64 + 16t .. of
//           its rows, pair j of them (channels 16t + 2j, or 64 + 16t + 2(j - 8)) is reduction pair j
//           of the MMA, and the queries (B) are held in the same order; int8 codes become fp16 pairs
//           of code + 1152 (1024 + 128 + code in the low byte: exact, one XOR and two PRMT a word);
//   values  A = V^T [channels, tokens]: channel row g of channel tile m is channel 16g + 2m (row g + 8:
//           16g + 2m + 1), so a lane's channels are 16g .. 16g + 15 of each of its tokens, one 16-byte
//           load a token for int8 (two for 16 bits), and a byte (or half) permute pairs two tokens'
//           codes of one channel into a register (int8: then one LOP3 makes them code + 1152). The
//           output rows come back in that order: a lane writes 16 contiguous channels of its heads.
// An 8-bit tail's offset of 1152 is not taken away code by code (one HSUB2 a register) but from the
// sums, in fp32: a score's MMAs start from -1152 x its head's query sum, and the values' offset,
// 1152 x the weights' sum, is one MMA a token tile. The sums lose a few of fp32's bits to the offset
// (codes span 8 of its 11 bits), far below the codes' own rounding.
// Keys of an 8-bit tail take fp16 queries: a bf16 group's queries are put on a power of two per head
// that brings the largest magnitude to [2^14, 2^15) (exact but for fp16's subnormals), the inverse
// taken with the scores. A 16-bit tail's dots take the model's dtype as stored.
// The step's token (`fresh`): the program of the slot it falls in writes it into the key q-buffer and
// the value window first (an 8-bit tail: codes round(x / s), s = max|x| / 127, as
// `kitty_core.regions.quantize_tokens` computes them), then its loads see it after `__syncwarp`.

struct TailArgs {
  PageArgs p;  // the queries, the key pages and table (a packed window slot), the partials, sizes
  const void* ks; const void* vs; long long sSb, sSh, sSt;  // sink [B, H, S, D]
  void* kb; long long sKBb, sKBh, sKBt;                      // key q-buffer [B, H, G, D]
  void* vw; long long sVWb, sVWh, sVWt;                      // value window [B, H, R + G, D]
  // an 8-bit tail's scales: a token's at its codes' element offset / D (all four tensors contiguous)
  const float* kss; const float* vss; float* kbs; float* vws;
  const int* lens; const int* nkp;
  const void* kn; long long sKNb, sKNh;  // the step's token [B, H, D] (fresh only)
  const void* vn; long long sVNb, sVNh;
  const long long* w; long long sW;  // its write positions in the q-buffer and the window [2, B]
  int sink, nt, fresh;
};

template <typename OT> struct Mma;
template <> struct Mma<half> {
  static __device__ __forceinline__ void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) { mma(c, a0, a1, a2, a3, b0, b1); }
  static __device__ __forceinline__ uint32_t pack(float x, float y) { return half2_bits(__floats2half2_rn(x, y)); }
};
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// An 8-bit tail's codes as fp16 operands carry an offset: code + BIAS, exact (a byte offset by 128 is
// the low byte of 0x64XX = 1024 + 128 + code). The offset leaves the MMAs' sums as BIAS x the sum of the
// other operand, taken away in fp32 where the sums are made: the score MMAs start from -BIAS x the
// query's sum, and the values' offset is one more MMA a token tile (rows of -BIAS on the weights).
constexpr float BIAS = 1152.f;
constexpr uint32_t NEG_BIAS2 = 0xe480e480u;  // -1152, -1152 in fp16

// four int8 codes -> two fp16 pairs of code + BIAS (codes 0, 1 and 2, 3)
__device__ __forceinline__ void int8_biased(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = x ^ 0x80808080u;
  lo = __byte_perm(u, 0x64646464u, 0x4140);
  hi = __byte_perm(u, 0x64646464u, 0x4342);
}

// codes at bytes 0 and 2 of x -> one fp16 pair of code + BIAS: the bytes flipped by 128 and the high
// bytes made 0x64 by one LOP3, (x & 0x00ff00ff) ^ c, c = 0x64806480 in a register (written in C++, the
// two immediates would take two)
__device__ __forceinline__ uint32_t int8_biased_pair(uint32_t x, uint32_t c) {
  uint32_t y;
  asm("lop3.b32 %0, %1, 0x00ff00ff, %2, 0x6a;" : "=r"(y) : "r"(x), "r"(c));
  return y;
}

// 16 bytes at p, or zeros where not live (a 16-bit tail's token past the count)
__device__ __forceinline__ uint4 load16(const void* p, bool live = true) {
  return live ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
}

// Pairs j = 0 .. 15 of a key row as the MMA's operand (channels 16t + 2j, 64 + 16t + 2(j - 8)); a 16-bit
// row not live is zeros (an 8-bit row is always read)
template <typename X>
__device__ __forceinline__ void key_row_pairs(uint32_t (&k)[16], const X* row, bool live, int t) {
  if constexpr (sizeof(X) == 1) {
    const uint4 x0 = load16(row + 16 * t), x1 = load16(row + 64 + 16 * t);
    const uint32_t v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int w = 0; w < 8; ++w) int8_biased(v[w], k[2 * w], k[2 * w + 1]);
  } else {
    const uint4 x[4] = {load16(row + 16 * t, live), load16(row + 16 * t + 8, live),
                        load16(row + 64 + 16 * t, live), load16(row + 64 + 16 * t + 8, live)};
#pragma unroll
    for (int i = 0; i < 4; ++i) { k[4 * i] = x[i].x; k[4 * i + 1] = x[i].y; k[4 * i + 2] = x[i].z; k[4 * i + 3] = x[i].w; }
  }
}

// The step's token (lane: channels 4 lane .. 4 lane + 3) stored at element `at` of a buffer
template <typename T, typename X>
__device__ __forceinline__ void store_token(X* buf, float* scales, long long at, const T* x, int lane) {
  const T* src = x + 4 * lane;
  if constexpr (sizeof(X) == 1) {
    float y[4], amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) { y[i] = to_f<T>(src[i]); amax = fmaxf(amax, fabsf(y[i])); }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
    const float s = amax * (float)(1.0 / 127.0);
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a correctly rounded division, ties to even: torch's numbers
      const float c = fminf(fmaxf(rintf(__fdiv_rn(y[i], fmaxf(s, 1e-30f))), -127.f), 127.f);
      word |= (uint32_t)((int)c & 0xff) << (8 * i);
    }
    *reinterpret_cast<uint32_t*>(buf + at + 4 * lane) = word;
    if (lane == 0) scales[at / D] = s;
  } else {
    *reinterpret_cast<uint2*>(buf + at + 4 * lane) = *reinterpret_cast<const uint2*>(src);
  }
}

// one warp's shared memory: with boosted channels, the copy of q x key scale; a packed key page's queries
// (fp16) and key half (the page kernel's layout)
template <int NB>
__host__ __device__ constexpr int tail_warp_bytes() {
  return round_up(QX_BYTES<NB> + RMAX * D * 2 + Layout<NB>::BYTES);
}

// The running softmax of a tail program: O^T tile m rows g, g + 8 = channels 16g + 2m, 16g + 2m + 1,
// columns heads 2t, 2t + 1; max (base 2) and sum of those heads
// and of an 8-bit tail, -BIAS x the weights' sum of those columns (rows alike), what the value codes'
// offset added to every row
struct Running {
  float acc[8][4];
  float m0, m1, l0, l1;
  float off[4];
};

// A tail program's tokens: token 0's keys and values and their token strides (elements), an 8-bit tail's
// scales (token 0's, and their token strides), and how many
struct TailTokens {
  const void* k; const void* v;
  int skt, svt;
  const float* kscale; const float* vscale;
  int kst, vst;
  int count;
};

// Fold a tail program's tokens into r, 32 at a time in tiles (P, jh) of a page's token order: scores from
// the key rows and the queries' pairs qb, the dots started from qo0 / qo1 and scaled by colf0 / colf1
// (the heads' columns), or (PACKED) a packed key page's scores sp [4][2][4], already scaled; values from
// the value rows. A token past the count (its weight is zero) is zeros in a 16-bit tail, its loads
// skipped, and in an 8-bit one the last token read again, which saves the predicates and the scales'
// index arithmetic: either way a buffer's stale rows, which may not be finite, never reach the MMAs, and
// no row is read past a buffer's end.
template <typename X, typename OT, bool PACKED>
__device__ __forceinline__ void attend(Running& r, const TailTokens& tk, const float* sp, const uint32_t* qb,
                                       float qo0, float qo1, float colf0, float colf1, int g, int t) {
  constexpr bool I8 = sizeof(X) == 1;
  const X* keys = static_cast<const X*>(tk.k);
  const X* values = static_cast<const X*>(tk.v);
  const int last = tk.count - 1;
  // ---- 32 tokens a step: tiles (P, jh) of a page's order (a packed slot: its key page's scores) ----
  for (int blk = 0; blk < tk.count; blk += GROUP) {
#pragma unroll 1
    for (int P = 0; P < 4; ++P) {
      const int base = blk + 32 * P;
      if (base >= tk.count) break;
      // this lane's value rows: tokens base + 8t + 4jh + i, channels 16g .. 16g + 15
      uint4 vr[2][4][sizeof(X) == 1 ? 1 : 2];
#pragma unroll
      for (int jh = 0; jh < 2; ++jh)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = base + 8 * t + 4 * jh + i;
          const X* row = values + (I8 ? min(tok, last) : tok) * tk.svt + 16 * g;
          vr[jh][i][0] = load16(row, I8 || tok < tk.count);
          if constexpr (!I8) vr[jh][i][1] = load16(row + 8, tok < tk.count);
        }
      float vsc[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // an 8-bit tail's value scales of rows g, g + 8
      if constexpr (I8) {
#pragma unroll
        for (int jh = 0; jh < 2; ++jh) {
          const int tok = base + key_row(g, jh, 0);
          vsc[jh][0] = tk.vscale[min(tok, last) * tk.vst];
          vsc[jh][1] = tk.vscale[min(tok + 1, last) * tk.vst];
        }
      }
      float s[2][4];
      float ksc[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // an 8-bit tail's key scales of rows g, g + 8
#pragma unroll
      for (int jh = 0; jh < 2; ++jh) {
        const int tok = base + key_row(g, jh, 0);  // rows g, g + 8: tokens tok, tok + 1
        if constexpr (PACKED) {
#pragma unroll
          for (int k = 0; k < 4; ++k) s[jh][k] = sp[((P * 2 + jh) * 4 + k) * 32 + (g * 4 + t)];
        } else {
          const int r0 = I8 ? min(tok, last) : tok, r1 = I8 ? min(tok + 1, last) : tok + 1;
          uint32_t k0[16], k1[16];
          key_row_pairs<X>(k0, keys + r0 * tk.skt, I8 || tok < tk.count, t);
          key_row_pairs<X>(k1, keys + r1 * tk.skt, I8 || tok + 1 < tk.count, t);
          float d[4] = {qo0, qo1, qo0, qo1};
#pragma unroll
          for (int kk = 0; kk < 8; ++kk)
            Mma<OT>::run(d, k0[2 * kk], k1[2 * kk], k0[2 * kk + 1], k1[2 * kk + 1], qb[2 * kk], qb[2 * kk + 1]);
          if constexpr (I8) {
            ksc[jh][0] = tk.kscale[r0 * tk.kst];
            ksc[jh][1] = tk.kscale[r1 * tk.kst];
          }
          s[jh][0] = d[0] * ksc[jh][0] * colf0; s[jh][1] = d[1] * ksc[jh][0] * colf1;
          s[jh][2] = d[2] * ksc[jh][1] * colf0; s[jh][3] = d[3] * ksc[jh][1] * colf1;
        }
        if (tok >= tk.count) { s[jh][0] = s[jh][1] = __int_as_float(0xff800000); }
        if (tok + 1 >= tk.count) { s[jh][2] = s[jh][3] = __int_as_float(0xff800000); }
      }

      // ---- online softmax (base 2) per head column ----
      float x0 = fmaxf(fmaxf(s[0][0], s[0][2]), fmaxf(s[1][0], s[1][2]));
      float x1 = fmaxf(fmaxf(s[0][1], s[0][3]), fmaxf(s[1][1], s[1][3]));
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(~0u, x0, o));
        x1 = fmaxf(x1, __shfl_xor_sync(~0u, x1, o));
      }
      const float n0 = fmaxf(r.m0, x0), n1 = fmaxf(r.m1, x1);
      if (__any_sync(~0u, n0 > r.m0 || n1 > r.m1)) {
        const float al0 = exp2_ftz(r.m0 - n0), al1 = exp2_ftz(r.m1 - n1);
        r.m0 = n0; r.m1 = n1; r.l0 *= al0; r.l1 *= al1;
#pragma unroll
        for (int i = 0; i < 8; ++i) { r.acc[i][0] *= al0; r.acc[i][1] *= al1; r.acc[i][2] *= al0; r.acc[i][3] *= al1; }
        if constexpr (I8) { r.off[0] *= al0; r.off[1] *= al1; r.off[2] *= al0; r.off[3] *= al1; }
      }

      // ---- values: the weights (x an 8-bit tail's value scales) as B, the value rows as A ----
#pragma unroll
      for (int jh = 0; jh < 2; ++jh) {
        const float vs0 = vsc[jh][0], vs1 = vsc[jh][1];
        const float p0 = exp2_ftz(s[jh][0] - n0), p1 = exp2_ftz(s[jh][1] - n1);
        const float p2 = exp2_ftz(s[jh][2] - n0), p3 = exp2_ftz(s[jh][3] - n1);
        r.l0 += p0 + p2; r.l1 += p1 + p3;
        const uint32_t b0 = transpose8x8(Mma<OT>::pack(p0 * vs0, p1 * vs0));
        const uint32_t b1 = transpose8x8(Mma<OT>::pack(p2 * vs1, p3 * vs1));
        if constexpr (I8) {
          const uint32_t x0[4] = {vr[jh][0][0].x, vr[jh][0][0].y, vr[jh][0][0].z, vr[jh][0][0].w};
          const uint32_t x1[4] = {vr[jh][1][0].x, vr[jh][1][0].y, vr[jh][1][0].z, vr[jh][1][0].w};
          const uint32_t x2[4] = {vr[jh][2][0].x, vr[jh][2][0].y, vr[jh][2][0].z, vr[jh][2][0].w};
          const uint32_t x3[4] = {vr[jh][3][0].x, vr[jh][3][0].y, vr[jh][3][0].z, vr[jh][3][0].w};
          const uint32_t hb = 0x64806480u;
#pragma unroll
          for (int wd = 0; wd < 4; ++wd)
#pragma unroll
            for (int e = 0; e < 2; ++e) {  // channel tile 2 wd + e: channels 16g + 4wd + 2e (+1)
              // a register: byte c of the word of tokens (i, i + 2) at bytes 0 and 2, one PRMT
              const uint32_t c0 = e ? 0x0602 : 0x0400, c1 = e ? 0x0703 : 0x0501;
              Mma<OT>::run(r.acc[2 * wd + e], int8_biased_pair(__byte_perm(x0[wd], x2[wd], c0), hb),
                           int8_biased_pair(__byte_perm(x0[wd], x2[wd], c1), hb),
                           int8_biased_pair(__byte_perm(x1[wd], x3[wd], c0), hb),
                           int8_biased_pair(__byte_perm(x1[wd], x3[wd], c1), hb), b0, b1);
            }
          Mma<OT>::run(r.off, NEG_BIAS2, NEG_BIAS2, NEG_BIAS2, NEG_BIAS2, b0, b1);
        } else {
          uint32_t x[4][8];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            x[i][0] = vr[jh][i][0].x; x[i][1] = vr[jh][i][0].y; x[i][2] = vr[jh][i][0].z; x[i][3] = vr[jh][i][0].w;
            x[i][4] = vr[jh][i][1].x; x[i][5] = vr[jh][i][1].y; x[i][6] = vr[jh][i][1].z; x[i][7] = vr[jh][i][1].w;
          }
#pragma unroll
          for (int j = 0; j < 8; ++j)  // channel tile j: channels 16g + 2j (+1)
            Mma<OT>::run(r.acc[j], __byte_perm(x[0][j], x[2][j], 0x5410), __byte_perm(x[0][j], x[2][j], 0x7632),
                         __byte_perm(x[1][j], x[3][j], 0x5410), __byte_perm(x[1][j], x[3][j], 0x7632), b0, b1);
        }
      }
    }
  }
}

template <typename T, typename X, int NB>
__global__ void __launch_bounds__(128) tail_kernel(const TailArgs ta) {
  constexpr bool I8 = sizeof(X) == 1;
  using OT = std::conditional_t<I8, half, T>;  // the MMAs' operand type
  const PageArgs& a = ta.p;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = ta.nt + 1;
  const int item = blockIdx.x * (blockDim.x >> 5) + warp;
  if (item >= a.batch * a.hkv * chunks) return;
  const int chunk = item % chunks;
  const int h = (item / chunks) % a.hkv;
  const int b = item / (chunks * a.hkv);

  // ---- the program's tokens: where its keys and values are, how many ----
  const int n = ta.lens[b], n_vp = a.nvp[b];
  const int c = n_vp + chunk - 1;  // a window program's slot
  const X* kbase;
  const X* vbase;
  long long kat, vat, skt, svt;  // element offsets of token 0, token strides
  const float* kscale;
  const float* vscale;
  int count;
  bool packed = false;
  if (chunk == 0) {
    count = min(n, ta.sink);
    kat = vat = b * ta.sSb + h * ta.sSh;
    skt = svt = ta.sSt;
    kbase = static_cast<const X*>(ta.ks); vbase = static_cast<const X*>(ta.vs);
    kscale = ta.kss; vscale = ta.vss;
  } else {
    count = min(n - (ta.sink + c * GROUP), GROUP);
    kat = b * ta.sKBb + h * ta.sKBh; skt = ta.sKBt;
    vat = b * ta.sVWb + h * ta.sVWh + (long long)(chunk - 1) * GROUP * ta.sVWt; svt = ta.sVWt;
    kbase = static_cast<const X*>(ta.kb); vbase = static_cast<const X*>(ta.vw);
    kscale = ta.kbs; vscale = ta.vws;
    packed = c < ta.nkp[b];
    if (ta.fresh && c == (n - 1 - ta.sink) / GROUP) {  // the step's token falls in this slot
      const long long k_at = b * ta.sKBb + h * ta.sKBh + ta.w[b] * ta.sKBt;
      const long long v_at = b * ta.sVWb + h * ta.sVWh + ta.w[ta.sW + b] * ta.sVWt;
      store_token<T, X>(static_cast<X*>(ta.kb), ta.kbs, k_at,
                        static_cast<const T*>(ta.kn) + b * ta.sKNb + h * ta.sKNh, lane);
      store_token<T, X>(static_cast<X*>(ta.vw), ta.vws, v_at,
                        static_cast<const T*>(ta.vn) + b * ta.sVNb + h * ta.sVNh, lane);
      __syncwarp();
    }
  }
  const long long mrow = b * a.sMb + (long long)(h * a.rep) * a.sMh + chunk;
  if (count <= 0) {  // a dead program: its max alone, -inf
    if (lane < a.rep) a.m[mrow + lane * a.sMh] = __int_as_float(0xff800000);
    return;
  }

  Running run;
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) run.acc[i][k] = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) run.off[k] = 0.f;
  run.m0 = run.m1 = __int_as_float(0xff800000);
  run.l0 = run.l1 = 0.f;
  // (an 8-bit tail's scales: a token's at its codes' element offset / D, all four tensors contiguous)
  const TailTokens tokens{kbase + kat, vbase + vat, (int)skt, (int)svt, I8 ? kscale + kat / D : nullptr,
                          I8 ? vscale + vat / D : nullptr, (int)(skt / D), (int)(svt / D), count};

  // ---- the queries: B operand pairs of head g in key_row_pairs' channel order (buffer keys), or fp16
  // in shared memory with the key page's half beside them (a packed slot: `page_key_scores`) ----
  const T* q = reinterpret_cast<const T*>(a.q) + b * a.sQb + (long long)(h * a.rep) * a.sQh;
  if (packed) {
    half* qx = reinterpret_cast<half*>(aligned_smem<NB>(smem) + warp * tail_warp_bytes<NB>());
    half* qs = qx + QX_BYTES<NB> / 2;
    uint8_t* st = reinterpret_cast<uint8_t*>(qs + RMAX * D);
    issue_keys<NB>(st, a, a.kt[b * a.sKT + c], h, lane);
    cp_commit();
    for (int i = lane; i < RMAX * D; i += 32) {
      const int r = i / D;
      qs[i] = r < a.rep ? __float2half_rn(to_f<T>(q[r * a.sQh + i % D])) : __float2half_rn(0.f);
    }
    cp_wait<0>();
    __syncwarp();
    float sp[4][2][4];
    page_key_scores<NB>(sp, st, qs, qx, g, t, a.scaling);
    // the scores to shared memory (over the page's key half, read): the token loop reads them by tile
    __syncwarp();
    float* ss = reinterpret_cast<float*>(st);
#pragma unroll
    for (int k = 0; k < 32; ++k) ss[k * 32 + lane] = (&sp[0][0][0])[k];
    __syncwarp();
    attend<X, OT, true>(run, tokens, ss, nullptr, 0.f, 0.f, 0.f, 0.f, g, t);
  } else {
    uint32_t qb[16];
    float colf0 = a.scaling, colf1 = a.scaling;  // what a column's (head 2t, 2t + 1) dots are scaled by
    uint4 x[4] = {};
    if (g < a.rep) {
      const T* row = q + g * a.sQh;
      x[0] = *reinterpret_cast<const uint4*>(row + 16 * t); x[1] = *reinterpret_cast<const uint4*>(row + 16 * t + 8);
      x[2] = *reinterpret_cast<const uint4*>(row + 64 + 16 * t); x[3] = *reinterpret_cast<const uint4*>(row + 72 + 16 * t);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) { qb[4 * i] = x[i].x; qb[4 * i + 1] = x[i].y; qb[4 * i + 2] = x[i].z; qb[4 * i + 3] = x[i].w; }
    if constexpr (I8 && !std::is_same_v<T, half>) {  // bf16 queries beside fp16 codes: a power of two per head
      const T* v = reinterpret_cast<const T*>(qb);
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(to_f<T>(v[i])));
      amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, 2));
      const int top = min(max((__float_as_int(amax) >> 23) & 0xff, 15), 254);  // biased exponent of the largest
      const float up = __int_as_float((268 - top) << 23), down = __int_as_float((top - 14) << 23);
      uint32_t f[16];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        f[j] = half2_bits(__floats2half2_rn(to_f<T>(v[2 * j]) * up, to_f<T>(v[2 * j + 1]) * up));
#pragma unroll
      for (int j = 0; j < 16; ++j) qb[j] = f[j];
      colf0 = __shfl_sync(~0u, down, 8 * t) * a.scaling;
      colf1 = __shfl_sync(~0u, down, 8 * t + 4) * a.scaling;
    }
    float qo0 = 0.f, qo1 = 0.f;  // an 8-bit tail's dots start from -BIAS x the sum of their head's query
    if constexpr (I8) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&qb[j]));
        sum += f.x + f.y;
      }
      sum += __shfl_xor_sync(~0u, sum, 1);
      sum += __shfl_xor_sync(~0u, sum, 2);
      qo0 = -BIAS * __shfl_sync(~0u, sum, 8 * t);
      qo1 = -BIAS * __shfl_sync(~0u, sum, 8 * t + 4);
    }
    attend<X, OT, false>(run, tokens, nullptr, qb, qo0, qo1, colf0, colf1, g, t);
  }

  // ---- the partial: max (natural log), sum, output = weighted values / sum ----
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    run.l0 += __shfl_xor_sync(~0u, run.l0, o);
    run.l1 += __shfl_xor_sync(~0u, run.l1, o);
  }
  if constexpr (I8) {  // the value codes' offset
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      run.acc[j][0] += run.off[0]; run.acc[j][1] += run.off[1]; run.acc[j][2] += run.off[2]; run.acc[j][3] += run.off[3];
    }
  }
  const int h0 = 2 * t, h1 = 2 * t + 1;
  const float r0 = 1.f / run.l0, r1 = 1.f / run.l1;
  T* out = reinterpret_cast<T*>(a.acc) + b * a.sAb + (long long)(h * a.rep) * a.sAh + chunk * a.sAc + 16 * g;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int hd = e ? h1 : h0;
    const float r = e ? r1 : r0;
    if (hd < a.rep) {
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = Mma<T>::pack(run.acc[j][e] * r, run.acc[j][2 + e] * r);
      uint4* dst = reinterpret_cast<uint4*>(out + hd * a.sAh);
      dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
  if (g == 0) {
    const float LN2 = 0.6931471805599453f;
    if (h0 < a.rep) { a.m[mrow + h0 * a.sMh] = run.m0 * LN2; a.l[mrow + h0 * a.sMh] = run.l0; }
    if (h1 < a.rep) { a.m[mrow + h1 * a.sMh] = run.m1 * LN2; a.l[mrow + h1 * a.sMh] = run.l1; }
  }
}

template <typename T, typename X, int NB>
int tail_launch_t(const TailArgs& a, int warps, cudaStream_t stream) {
  return launch_warps<tail_kernel<T, X, NB>>(a, (long long)a.p.batch * a.p.hkv * (a.nt + 1), tail_warp_bytes<NB>(),
                                             warps, stream);
}

}  // namespace
}  // namespace kitty

// One build holds one boosted-channel count and pipeline depth (both dtypes): each takes ~30 s of
// nvcc, so a process builds only the boosted-channel counts its layers use (both depths of each:
// the launch plan picks the depth by the grid's size).
#ifndef KITTY_NB
#define KITTY_NB 32
#endif
#ifndef KITTY_STAGES
#define KITTY_STAGES 2
#endif

// host entry: dtype 0 fp16, 1 bf16; returns a cudaError_t (0: launched)
int kitty_pages_launch(kitty::PageArgs a, int dtype, int warps, void* stream) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (warps < 1 || warps > 4) return -2;
  return dtype ? kitty::launch_t<__nv_bfloat16, KITTY_NB, KITTY_STAGES>(a, warps, s)
               : kitty::launch_t<half, KITTY_NB, KITTY_STAGES>(a, warps, s);
}

// host entry of the tail: dtype 0 fp16, 1 bf16; tail8: int8 codes in the tail's buffers
int kitty_tail_launch(kitty::TailArgs a, int dtype, int tail8, int warps, void* stream) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (warps < 1 || warps > 4) return -2;
  if (tail8)
    return dtype ? kitty::tail_launch_t<__nv_bfloat16, int8_t, KITTY_NB>(a, warps, s)
                 : kitty::tail_launch_t<half, int8_t, KITTY_NB>(a, warps, s);
  return dtype ? kitty::tail_launch_t<__nv_bfloat16, __nv_bfloat16, KITTY_NB>(a, warps, s)
               : kitty::tail_launch_t<half, half, KITTY_NB>(a, warps, s);
}
