/* AMX tile state, shared by the AMX attention items (flash_amx.h) and the AMX linear (amx_linear.c). */
#ifndef PS_AMX_TILES_H
#define PS_AMX_TILES_H
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ps_tilecfg;

/* Linux gives a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA); asking again is a no-op. 1 when granted. */
static inline int ps_amx_permitted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* Tiles 0-7 with rows[t] rows of 64 bytes, on this thread (a tile multiply's A and C rows must agree). */
static inline void ps_amx_configure_rows(const uint8_t rows[8]) {
    ps_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = rows[t];
    }
    _tile_loadconfig(&cfg);
}

/* Eight tiles of 16 rows x 64 bytes, on this thread. */
static inline void ps_amx_configure(void) {
    static const uint8_t full[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    ps_amx_configure_rows(full);
}
#endif
