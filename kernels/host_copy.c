/* Host-memory moves of the CPU copy path, in one call each (kernels/host_copy.py builds and loads this file).

   No Python here: the loader calls these through ctypes, holding the GIL for a small move and releasing it for a
   large one, so that a move of many pieces costs one call (and beside a busy Python thread at most one wait for
   the GIL) instead of one numpy or torch op per piece length and plane.

   Every address and length was validated by the caller (kernels/base.py `check_pieces`, the value format's
   lengths): nothing here checks bounds. Source and destination ranges never overlap (cache vs staging). */

#include <stdint.h>
#include <string.h>

/* Pieces between a PlaneSet's planes and value-major staging (kernels/base.py).

   table: int64 [5][stride] (row r at table + r * stride), its first m columns used: start slot, count, base,
       value tokens, index in value.
   plane_addr, block_stride, slot_stride, plane_offset, row_bytes: int64 [planes], bytes (plane_offset: the
       plane's row offset inside one staging token).
   Plane p's rows of piece i: cache  plane_addr[p] + (start / block_size) * block_stride[p]
                                     + (start % block_size + k) * slot_stride[p]
                              staging flat + base + tokens * plane_offset[p] + (index + k) * row_bytes[p],
   k < count: one memcpy of count * row_bytes[p] where the plane's rows are contiguous in a block, else one per row.
   Pieces outer, planes inner: a value's plane-major staging part is walked front to back. */
static void move_piece_range(const int64_t *table, int64_t first, int64_t end, int64_t stride,
                             const int64_t *plane_addr, const int64_t *block_stride, const int64_t *slot_stride,
                             const int64_t *plane_offset, const int64_t *row_bytes, int64_t planes,
                             int64_t block_size, int64_t flat, int32_t gather) {
    const int64_t *start = table, *count = table + stride, *base = table + 2 * stride;
    const int64_t *tokens = table + 3 * stride, *index = table + 4 * stride;
    for (int64_t i = first; i < end; i++) {
        const int64_t block = start[i] / block_size, within = start[i] % block_size, c = count[i];
        for (int64_t p = 0; p < planes; p++) {
            const int64_t r = row_bytes[p], step = slot_stride[p];
            char *cache = (char *)(intptr_t)(plane_addr[p] + block * block_stride[p] + within * step);
            char *stage = (char *)(intptr_t)(flat + base[i] + tokens[i] * plane_offset[p] + index[i] * r);
            if (step == r) {
                if (gather) memcpy(stage, cache, (size_t)(c * r));
                else memcpy(cache, stage, (size_t)(c * r));
                continue;
            }
            for (int64_t k = 0; k < c; k++, cache += step, stage += r) {
                if (gather) memcpy(stage, cache, (size_t)r);
                else memcpy(cache, stage, (size_t)r);
            }
        }
    }
}

void ems_move_pieces(const int64_t *table, int64_t m, int64_t stride, const int64_t *plane_addr,
                     const int64_t *block_stride, const int64_t *slot_stride, const int64_t *plane_offset,
                     const int64_t *row_bytes, int64_t planes, int64_t block_size, int64_t flat, int32_t gather) {
    move_piece_range(table, 0, m, stride, plane_addr, block_stride, slot_stride, plane_offset, row_bytes, planes,
                     block_size, flat, gather);
}

/* Raw segments (V0 KvBufferWrapper ranges): flat[sum(lengths[:i]) : ... + lengths[i]] <-> bytes at ptrs[i]. */
void ems_move_segments(const int64_t *ptrs, const int64_t *lengths, int64_t n, int64_t flat, int32_t gather) {
    char *position = (char *)(intptr_t)flat;
    for (int64_t i = 0; i < n; i++) {
        char *segment = (char *)(intptr_t)ptrs[i];
        if (gather) memcpy(position, segment, (size_t)lengths[i]);
        else memcpy(segment, position, (size_t)lengths[i]);
        position += lengths[i];
    }
}

/* out[i] = hash(bytes at ptrs[i], lengths[i]) for i < n, `hash` being the xxhash extension's own XXH3_64bits
   (its address is passed in: the digests are xxhash's, bit for bit). */
typedef uint64_t (*ems_hash_fn)(const void *, size_t);

void ems_hash_many(ems_hash_fn hash, const int64_t *ptrs, const int64_t *lengths, uint64_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = hash((const void *)(intptr_t)ptrs[i], (size_t)lengths[i]);
}

/* A load's verify and scatter in one pass, value by value, so that each value is read once, while it is in cache:
   for v < n_values, digest = hash(bytes at payload_addr[v], payload_len[v]); at the first v whose digest is not
   expected[v], stop and return v (nothing of v or after it is written); else scatter its pieces, table columns
   piece_end[v - 1] .. piece_end[v] - 1 (piece_end[-1] read as 0), as ems_move_pieces does. Returns n_values when
   every value matched. */
int64_t ems_verify_scatter_pieces(ems_hash_fn hash, const int64_t *payload_addr, const int64_t *payload_len,
                                  const uint64_t *expected, const int64_t *piece_end, int64_t n_values,
                                  const int64_t *table, int64_t stride, const int64_t *plane_addr,
                                  const int64_t *block_stride, const int64_t *slot_stride,
                                  const int64_t *plane_offset, const int64_t *row_bytes, int64_t planes,
                                  int64_t block_size, int64_t flat) {
    int64_t first = 0;
    for (int64_t v = 0; v < n_values; v++) {
        if (hash((const void *)(intptr_t)payload_addr[v], (size_t)payload_len[v]) != expected[v]) return v;
        move_piece_range(table, first, piece_end[v], stride, plane_addr, block_stride, slot_stride, plane_offset,
                         row_bytes, planes, block_size, flat, 0);
        first = piece_end[v];
    }
    return n_values;
}

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define EMS_STREAMING_STORES 1
#endif

#define EMS_STREAM_FROM ((int64_t)256 << 10) /* copies this large or larger bypass the cache (x86) */

/* n bytes from s to d; from EMS_STREAM_FROM on with streaming (non-temporal) stores where the CPU has them: a
   large copy's destination is not read again soon by this core, and its lines then skip the read-for-ownership
   of a cached store (a third faster for 1 MiB values on this project's CI host). The caller fences. */
static void copy_streaming(char *d, const char *s, int64_t n) {
#ifdef EMS_STREAMING_STORES
    if (n >= EMS_STREAM_FROM) {
        const int64_t head = (int64_t)((16 - ((uintptr_t)d & 15)) & 15);
        memcpy(d, s, (size_t)head);
        int64_t i = head;
        for (; i + 64 <= n; i += 64) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            const __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + i, s + i, (size_t)(n - i));
        return;
    }
#endif
    memcpy(d, s, (size_t)n);
}

/* Copies between buffers: dst[i] <- src[i], lengths[i] bytes, for i < n (int64 [n] each; addresses). A node's
   batch of values into a shared-memory region, in one call; the stores are fenced before it returns, so they are
   visible to the region's reader once the reply is sent. */
void ems_copy_many(const int64_t *dst, const int64_t *src, const int64_t *lengths, int64_t n) {
    for (int64_t i = 0; i < n; i++) copy_streaming((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], lengths[i]);
#ifdef EMS_STREAMING_STORES
    _mm_sfence();
#endif
}

/* XXH3's streaming functions, by address (the xxhash extension's own; kernels/host_copy.py passes them in an
   int64 [5] table in this order), so that a value is hashed piece by piece as it is copied. */
typedef struct {
    void *(*create)(void);
    int (*release)(void *);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    uint64_t (*digest)(const void *);
} ems_stream_hash;

#define EMS_COPY_HASH_STEP ((int64_t)64 << 10) /* copied, then hashed while in L1/L2 */

/* ems_copy_many, and out[i] = XXH3-64 of dst[i] + skip .. dst[i] + lengths[i] (every lengths[i] >= skip): a
   node's save, each value copied out of a region and its payload checked in one pass. The copy is hashed, never
   the source (which its client can still write), each step right after it is copied, while its bytes are in
   cache. Returns 0, or -1 when the hash state cannot be allocated (nothing copied). */
int64_t ems_copy_hash_many(const int64_t *hasher, const int64_t *dst, const int64_t *src, const int64_t *lengths,
                           int64_t skip, uint64_t *out, int64_t n) {
    ems_stream_hash h;
    memcpy(&h, hasher, sizeof h);
    void *state = h.create();
    if (state == NULL) return -1;
    for (int64_t i = 0; i < n; i++) {
        char *to = (char *)(intptr_t)dst[i];
        const char *from = (const char *)(intptr_t)src[i];
        memcpy(to, from, (size_t)skip);
        h.reset(state);
        for (int64_t at = skip; at < lengths[i]; at += EMS_COPY_HASH_STEP) {
            const int64_t k = lengths[i] - at < EMS_COPY_HASH_STEP ? lengths[i] - at : EMS_COPY_HASH_STEP;
            memcpy(to + at, from + at, (size_t)k);
            h.update(state, to + at, (size_t)k);
        }
        out[i] = h.digest(state);
    }
    h.release(state);
    return 0;
}
