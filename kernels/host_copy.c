/* Host-memory moves of the CPU copy path, in one call each (kernels/host_copy.py builds and loads this file).

   No Python here: the loader calls these through ctypes, holding the GIL for a small move and releasing it for a
   large one, so that a move of many pieces costs one call (and beside a busy Python thread at most one wait for
   the GIL) instead of one numpy or torch op per piece length and plane.

   Every address and length was validated by the caller (kernels/base.py `check_pieces`, the value format's
   lengths): nothing here checks bounds. Source and destination ranges never overlap (cache vs staging). */

#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "value headers are little-endian: this file reads and writes them in place"
#endif
#define EMS_HEAD_CHECKED 32 /* a value header's bytes before its checksum: magic .. payload_len (value_format.py) */

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

/* A save's encode in one call: for v < n, the value at value_addr[v] gets its 40-byte header, heads[v * 32 ..
   v * 32 + 32) (magic, version, kind, layout, tokens, payload length) and then the XXH3 of its payload (the
   payload_len[v] bytes after the header), computed here while the value's bytes are the last ones written. */
static void encode_value(ems_hash_fn hash, const unsigned char *head, int64_t value_addr, int64_t payload_len) {
    unsigned char *value = (unsigned char *)(intptr_t)value_addr;
    const uint64_t digest = hash(value + EMS_HEAD_CHECKED + sizeof digest, (size_t)payload_len);
    memcpy(value, head, EMS_HEAD_CHECKED);
    memcpy(value + EMS_HEAD_CHECKED, &digest, sizeof digest);
}

void ems_encode_values(ems_hash_fn hash, const unsigned char *heads, const int64_t *value_addr,
                       const int64_t *payload_len, int64_t n) {
    for (int64_t v = 0; v < n; v++) encode_value(hash, heads + v * EMS_HEAD_CHECKED, value_addr[v], payload_len[v]);
}

/* A save's gather and encode in one pass, value by value, so that each value is hashed right after its bytes were
   written, while they are in cache: for v < n_values, gather its pieces (table columns piece_end[v - 1] ..
   piece_end[v] - 1, piece_end[-1] read as 0, as ems_move_pieces does), then give the value at value_addr[v] its
   header as ems_encode_values does. */
void ems_gather_encode_pieces(ems_hash_fn hash, const unsigned char *heads, const int64_t *value_addr,
                              const int64_t *payload_len, const int64_t *piece_end, int64_t n_values,
                              const int64_t *table, int64_t stride, const int64_t *plane_addr,
                              const int64_t *block_stride, const int64_t *slot_stride, const int64_t *plane_offset,
                              const int64_t *row_bytes, int64_t planes, int64_t block_size, int64_t flat) {
    int64_t first = 0;
    for (int64_t v = 0; v < n_values; v++) {
        move_piece_range(table, first, piece_end[v], stride, plane_addr, block_stride, slot_stride, plane_offset,
                         row_bytes, planes, block_size, flat, 1);
        encode_value(hash, heads + v * EMS_HEAD_CHECKED, value_addr[v], payload_len[v]);
        first = piece_end[v];
    }
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
   visible to the region's reader once the reply is sent.
   progress: 0, or the address of a u32 in that region (its reader's, 4-byte aligned, outside every dst range):
   after copy i, for i < signalled, the stores are fenced and i + 1 is stored there with release order, then its
   waiters are woken (a shared futex), so that the reader may take value i before the whole batch is done (a
   same-host load scattering as the node places: `ems_verify_scatter_as_placed`). */
void ems_copy_many(const int64_t *dst, const int64_t *src, const int64_t *lengths, int64_t n, int64_t progress,
                   int64_t signalled) {
    for (int64_t i = 0; i < n; i++) {
        copy_streaming((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], lengths[i]);
        if (progress != 0 && i < signalled) {
#ifdef EMS_STREAMING_STORES
            _mm_sfence();  /* streaming stores are weakly ordered: visible before the count that covers them */
#endif
            __atomic_store_n((uint32_t *)(intptr_t)progress, (uint32_t)(i + 1), __ATOMIC_RELEASE);
#ifdef __linux__
            syscall(SYS_futex, (uint32_t *)(intptr_t)progress, FUTEX_WAKE, 1, NULL, NULL, 0);
#endif
        }
    }
#ifdef EMS_STREAMING_STORES
    _mm_sfence();
#endif
}

#define EMS_WAIT_SLICE_NS 1000000L /* a wait for the next value re-checks the deadline and the socket this often */

static int64_t monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000L + now.tv_nsec;
}

/* A same-host load's verify and scatter while the node is still placing its values (the client side of
   ems_copy_many's progress): for v < n_values, wait until the u32 at `progress` exceeds v (acquire order; a shared
   futex wait in slices of EMS_WAIT_SLICE_NS), then check value v as ems_verify_scatter_pieces does, its header
   too: the value at value_addr[v] must start with heads[v * 32 .. v * 32 + 32) (magic, version, kind, layout,
   tokens, payload length: what the load expects) and its payload (payload_len[v] bytes after the 40-byte header)
   must hash to the checksum its header states; then scatter its pieces. Returns how many values were verified and
   written, from the first, and sets *why: 0 every value, 1 value `returned` failed its check (stop the load there),
   2 interrupted before value `returned` arrived: `fd` became readable or hung up (a reply on the region's channel:
   ours, for a value the node will not place, or another request's), or `deadline_ns` (CLOCK_MONOTONIC) passed.
   Nothing of a value is written before it is checked, nor anything after the first that fails. */
int64_t ems_verify_scatter_as_placed(ems_hash_fn hash, int64_t progress, int32_t fd, int64_t deadline_ns,
                                     const unsigned char *heads, const int64_t *value_addr, const int64_t *payload_len,
                                     const int64_t *piece_end, int64_t n_values, int64_t *why, const int64_t *table,
                                     int64_t stride, const int64_t *plane_addr, const int64_t *block_stride,
                                     const int64_t *slot_stride, const int64_t *plane_offset,
                                     const int64_t *row_bytes, int64_t planes, int64_t block_size, int64_t flat) {
    int64_t first = 0;
    *why = 0;
#ifndef __linux__
    (void)progress, (void)fd, (void)deadline_ns;
    *why = 2; /* no futex, no poll here: the caller waits for the reply instead */
    return 0;
#else
    uint32_t *word = (uint32_t *)(intptr_t)progress;
    for (int64_t v = 0; v < n_values; v++) {
        uint32_t placed;
        while ((placed = __atomic_load_n(word, __ATOMIC_ACQUIRE)) <= (uint32_t)v) {
            struct pollfd channel = {fd, POLLIN, 0};
            if (monotonic_ns() >= deadline_ns || poll(&channel, 1, 0) != 0) {
                *why = 2;
                return v;
            }
            struct timespec slice = {0, EMS_WAIT_SLICE_NS};
            syscall(SYS_futex, word, FUTEX_WAIT, placed, &slice, NULL, 0);
        }
        const unsigned char *value = (const unsigned char *)(intptr_t)value_addr[v];
        uint64_t stated;
        memcpy(&stated, value + EMS_HEAD_CHECKED, sizeof stated); /* little-endian, as the header is */
        if (memcmp(value, heads + v * EMS_HEAD_CHECKED, EMS_HEAD_CHECKED) != 0 ||
            hash(value + EMS_HEAD_CHECKED + sizeof stated, (size_t)payload_len[v]) != stated) {
            *why = 1;
            return v;
        }
        move_piece_range(table, first, piece_end[v], stride, plane_addr, block_stride, slot_stride, plane_offset,
                         row_bytes, planes, block_size, flat, 0);
        first = piece_end[v];
    }
    return n_values;
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

/* The token form's block keys (ems/datapath/tokens.py), chained: digest j = XXH3-128(digest j-1 || the tokens of
   block j), digest -1 = the 16 bytes at `seed`, block j = tokens[j * block .. min((j + 1) * block, n)) as int64
   (little-endian: this file builds only there). `hash` is the xxhash extension's own XXH3_128bits (by address), and
   each digest is written to out + 16 * j in XXH128's canonical form (high half then low half, big-endian): the
   bytes of xxhash's `xxh3_128_digest`, bit for bit. `scratch`: 16 + 8 * block bytes. */
typedef struct {
    uint64_t low64, high64;
} ems_hash128;
typedef ems_hash128 (*ems_hash128_fn)(const void *, size_t);

static void put_big_endian(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) out[i] = (unsigned char)v;
}

void ems_chain_digests(ems_hash128_fn hash, const unsigned char *seed, const int64_t *tokens, int64_t n,
                       int64_t block, unsigned char *scratch, unsigned char *out) {
    const unsigned char *previous = seed;
    for (int64_t first = 0; first < n; first += block, out += 16) {
        const int64_t count = n - first < block ? n - first : block;
        memcpy(scratch, previous, 16);
        memcpy(scratch + 16, tokens + first, (size_t)count * sizeof *tokens);
        const ems_hash128 digest = hash(scratch, 16 + (size_t)count * sizeof *tokens);
        put_big_endian(out, digest.high64);
        put_big_endian(out + 8, digest.low64);
        previous = out;
    }
}
