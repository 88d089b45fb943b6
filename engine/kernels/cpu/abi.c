/* The library's interface constants by name, for engine/kernels/cpu_native.py to check when it
   loads the library (kvarena_native.h has why). */

#include "kvarena_native.h"

#define ENTRY(name) {#name, name}

static const struct {
    const char *name;
    int64_t value;
} abi[] = {
    ENTRY(KV_ABI_VERSION),
    ENTRY(KV_OK), ENTRY(KV_BAD_PAGE), ENTRY(KV_BAD_LENGTH), ENTRY(KV_BAD_SLOT), ENTRY(KV_BAD_HOLE),
    ENTRY(KV_BAD_SHAPE), ENTRY(KV_NO_MEMORY),
    ENTRY(KV_PANEL),
    ENTRY(KV_LAYER_FIELDS), ENTRY(KV_INPUT_NORM), ENTRY(KV_QKV), ENTRY(KV_QKV_BIAS), ENTRY(KV_O),
    ENTRY(KV_POST_NORM), ENTRY(KV_GATE_UP), ENTRY(KV_DOWN),
};

int64_t kv_abi(const char **names, int64_t *values, int64_t capacity) {
    const int64_t count = (int64_t)(sizeof abi / sizeof *abi);
    for (int64_t i = 0; i < count && i < capacity; i++) {
        names[i] = abi[i].name;
        values[i] = abi[i].value;
    }
    return count;
}
