#include "ps_cpu.h"

/* ---------------------------------------------------------------------------------------------
 * store_kv: copy each new token's K and V rows (Hkv * D contiguous elements, row_bytes) into its
 * cache slot (slot = block * BS + offset; a negative slot is padding, skipped). All slots are
 * checked against the pool first: on one outside [-inf, nslots) nothing is written and 1 returned.
 * Why C: index_copy_ pays ~30 us of TensorIterator set-up per call, twice per layer per step.
 */
int64_t ps_store_kv(const char *k, const char *v, char *kc, char *vc, const int64_t *slots, int64_t T,
                    int64_t row_bytes, int64_t k_st, int64_t v_st, int64_t kc_ss, int64_t vc_ss, int64_t nslots) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= nslots) return 1;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        memcpy(kc + s * kc_ss, k + t * k_st, (size_t)row_bytes);
        memcpy(vc + s * vc_ss, v + t * v_st, (size_t)row_bytes);
    }
    return 0;
}
