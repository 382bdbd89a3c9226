/*
 * The VMM allocator's segments into an arena file (a snapshot) and back (its resume or
 * restore): the file is what CRIU's images carry for them (kernel_magics/gpu_vmm.py). Half of
 * libinfinijup_vmm.so, with vmm_alloc.c (see vmm_alloc.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include "vmm_alloc.h"

static int copy_given; /* ij_set_copy was called: the next ij_sleep_into copies s->copy only */
static int last_errno; /* the arena file's, when ij_sleep_into could not reserve its pages */

/* --- segments into a file (a snapshot) and back (its resume or restore) -----------------------
 * Only what PyTorch has in use is copied (ij_set_live); the file's pages under dead ranges are
 * given back. Threads copy the ranges piece by piece through pinned bounce buffers
 * (copy_pieces). Nothing of the file stays mapped: CRIU has no GPU bytes to dump. */

#define MERGE_GAP (1u << 20) /* live ranges closer than this are copied as one */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* The file's pages under [base, base + len) present and writable (a kernel without
 * MADV_POPULATE_WRITE: each page touched). */
static void make_present(char *base, size_t len) {
    if (madvise(base, len, MADV_POPULATE_WRITE) == 0) return;
    for (size_t off = 0; off < len; off += 4096) base[off] = base[off];
}

/* Map `len` bytes of `fd` (copied piece by piece in copy_pieces); NULL on failure. */
static char *map_file(int fd, size_t len, int write) {
    char *base = mmap(NULL, len, write ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    return base == MAP_FAILED ? NULL : base;
}

static void unmap_file(char *base, size_t len) { munmap(base, len); }

/* The pairs that fall in segment s, relative to s->ptr, clipped to it and merged across gaps
 * under `gap`; NULL when memory runs out. */
static size_t *ranges_in(const Segment *s, const unsigned long long *pairs, int n, size_t gap,
                         int *count) {
    int inside = 0;
    for (int i = 0; i < n; i++)
        if (pairs[2 * i + 1] && pairs[2 * i] < s->ptr + s->size &&
            pairs[2 * i] + pairs[2 * i + 1] > s->ptr) inside++;
    size_t *list = malloc(sizeof(size_t) * 2 * (size_t)(inside ? inside : 1));
    if (!list) return NULL;
    int k = 0;
    for (int i = 0; i < n; i++) {
        unsigned long long a = pairs[2 * i], len = pairs[2 * i + 1];
        if (len == 0 || a >= s->ptr + s->size || a + len <= s->ptr) continue;
        size_t start = a < s->ptr ? 0 : (size_t)(a - s->ptr);
        size_t end = a + len > s->ptr + s->size ? s->size : (size_t)(a + len - s->ptr);
        if (k > 0 && start <= list[2 * k - 2] + list[2 * k - 1] + gap) {
            if (end > list[2 * k - 2] + list[2 * k - 1]) list[2 * k - 1] = end - list[2 * k - 2];
            continue;
        }
        list[2 * k] = start;
        list[2 * k + 1] = end - start;
        k++;
    }
    *count = k;
    return list;
}

/* What PyTorch has in use, as (address, length) pairs sorted by address (its memory snapshot:
 * blocks not "inactive"), merged across gaps under MERGE_GAP. The next ij_sleep_into copies
 * only these ranges (the rest of a segment is cached but free: dead bytes no snapshot should
 * hold) and ij_wake_from copies back only them. n < 0: forget, copy whole segments. */
int ij_set_live(const unsigned long long *pairs, int n) {
    pthread_mutex_lock(&lock);
    for (Segment *s = segments; s; s = s->next) {
        free(s->live);
        s->live = NULL;
        s->nlive = 0;
        if (n >= 0) s->live = ranges_in(s, pairs, n, MERGE_GAP, &s->nlive); /* NULL: all */
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

/* What the next ij_sleep_into copies, as (address, length) pairs sorted by address: the live
 * ranges whose contents changed since the last ij_sleep_into into the same file (the caller
 * compares hashes; see block_hash.py). The rest of the live ranges is already in the file at
 * the segments' offsets. n < 0: copy every live range. Used once, then forgotten. */
int ij_set_copy(const unsigned long long *pairs, int n) {
    int ok = 1;
    pthread_mutex_lock(&lock);
    copy_given = n >= 0;
    for (Segment *s = segments; s; s = s->next) {
        free(s->copy);
        s->copy = NULL;
        s->ncopy = 0;
        if (n >= 0 && !(s->copy = ranges_in(s, pairs, n, 0, &s->ncopy))) ok = 0;
    }
    if (!ok) copy_given = 0; /* out of memory: copy everything */
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}

/* Give each segment on the GPU that has none an offset in the arena file, after every offset
 * given before: a segment keeps its offset from one snapshot to the next, so the file's bytes
 * of an unchanged range are already where the next snapshot would write them. Returns the
 * file's length. (Called with the lock held.) */
static size_t place_segments(void) {
    size_t end = 0;
    for (Segment *s = segments; s; s = s->next)
        if (s->placed && s->offset + s->size > end) end = s->offset + s->size;
    for (Segment *s = segments; s; s = s->next) {
        if (!s->mapped || s->placed) continue;
        s->offset = end;
        s->placed = 1;
        end += s->size;
    }
    return end;
}

/* The segments on the GPU as (address, size, file offset, device) quadruples, at most `max`;
 * the count. Gives offsets to the segments that had none (place_segments). */
int ij_layout(unsigned long long *out, int max) {
    int k = 0;
    pthread_mutex_lock(&lock);
    place_segments();
    for (Segment *s = segments; s; s = s->next) {
        if (!s->mapped) continue;
        if (k < max) {
            out[4 * k] = s->ptr;
            out[4 * k + 1] = s->size;
            out[4 * k + 2] = s->offset;
            out[4 * k + 3] = (unsigned long long)s->device;
        }
        k++;
    }
    pthread_mutex_unlock(&lock);
    return k;
}

/* Seconds spent by the last ij_sleep_into or ij_wake_from, part by part (ij_timings): [0] the
 * calling thread's wait for the pieces; summed over the copying threads, [1] making the file's
 * pages present and allocating the bounce buffers, [2] the copies to or from the GPU, [3]
 * freeing the buffers, [4] the copies between the buffers and the file's pages. */
static double spent[5];

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

void ij_timings(double *out) {
    for (int i = 0; i < 5; i++) out[i] = spent[i];
}

/* Both ways, in pieces of at most PIECE bytes (the ranges to copy, cut at PIECE boundaries),
 * the cards' pieces in turn (cards_in_turn), taken in that order by COPIERS threads. Each
 * thread owns one pinned bounce buffer of STAGE bytes per card, allocated at its first piece
 * on that card and freed at the end; for each piece it makes the file's pages present (a new
 * tmpfs file costs its page allocations and zeroing here) and copies the piece through its
 * buffer, STAGE bytes at a time: GPU to buffer, buffer to pages, or the other way. Small
 * buffers were faster: 24 GB on one H200, 12 threads, went out in 0.81 s into a file that had
 * its pages, against 1.41 s through 64 MiB buffers and 6 threads (docs/benchmarks.md). Likely
 * because a small buffer is still in the CPU's cache between the DMA and the memcpy (not
 * measured). The file's pages themselves are never pinned: unpinning a piece costs more with
 * every context that can reach it (with peer access on between two cards, 4.4 s of a 29 GB
 * snapshot). */
#define PIECE (64u << 20)
#define STAGE (4u << 20)
#define COPIERS 12     /* threads, unless INFINIJUP_VMM_COPIERS says how many (1 to MAX_COPIERS) */
#define MAX_COPIERS 64

typedef struct {
    char *page; /* the piece's first page and the span of its pages */
    size_t span;
    char *host;
    CUdeviceptr dev;
    size_t len;
    int device; /* the segment's: its context copies the piece */
    int done;
    CUresult res;
} Piece;

typedef struct {
    Piece *piece;
    int count;
    int next;    /* the next piece a thread takes */
    int stop;    /* a piece failed: the rest are not copied */
    int to_host; /* 1: out of the GPU into the file; 0: back from the file */
    pthread_mutex_t m;
    pthread_cond_t c;
    double spent[5]; /* the threads' sums, under m */
} Plan;

static int make_current(int device, int *current) {
    if (*current == device) return 1;
    if (!device_ctx[device] || cu.ctx_set_current(device_ctx[device]) != 0) return 0;
    *current = device;
    return 1;
}

static void copy_piece(Plan *plan, Piece *p, void **buffer, int *current, double *t) {
    double t0 = now_s();
    if (plan->to_host) make_present(p->page, p->span);
    if (!make_current(p->device, current)) {
        p->res = 201; /* CUDA_ERROR_INVALID_CONTEXT */
        return;
    }
    if (!buffer[p->device] && cu.alloc_host(&buffer[p->device], STAGE) != 0) {
        buffer[p->device] = NULL;
        p->res = 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        return;
    }
    char *b = buffer[p->device];
    double t1 = now_s(), t2;
    t[1] += t1 - t0;
    for (size_t off = 0; off < p->len && p->res == 0; off += STAGE) {
        size_t n = p->len - off < STAGE ? p->len - off : STAGE;
        t1 = now_s();
        if (plan->to_host) {
            p->res = cu.dtoh(b, p->dev + off, n);
            t2 = now_s();
            if (p->res == 0) memcpy(p->host + off, b, n);
            t[2] += t2 - t1;
            t[4] += now_s() - t2;
        } else {
            memcpy(b, p->host + off, n);
            t2 = now_s();
            p->res = cu.htod(p->dev + off, b, n);
            t[4] += t2 - t1;
            t[2] += now_s() - t2;
        }
    }
}

static void *copy_thread(void *arg) {
    Plan *plan = arg;
    int current = -1; /* the device whose context this thread has made current */
    void *buffer[MAX_DEVICES] = {0};
    double t[5] = {0};
    for (;;) {
        int i = __atomic_fetch_add(&plan->next, 1, __ATOMIC_SEQ_CST);
        if (i >= plan->count) break;
        Piece *p = &plan->piece[i];
        if (__atomic_load_n(&plan->stop, __ATOMIC_SEQ_CST)) p->res = 999; /* not copied */
        else copy_piece(plan, p, buffer, &current, t);
        if (p->res != 0) __atomic_store_n(&plan->stop, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_lock(&plan->m);
        p->done = 1;
        pthread_cond_broadcast(&plan->c);
        pthread_mutex_unlock(&plan->m);
    }
    double t0 = now_s();
    for (int d = 0; d < MAX_DEVICES; d++)
        if (buffer[d] && make_current(d, &current)) cu.free_host(buffer[d]);
    t[3] += now_s() - t0;
    pthread_mutex_lock(&plan->m);
    for (int k = 1; k < 5; k++) plan->spent[k] += t[k];
    pthread_mutex_unlock(&plan->m);
    return NULL;
}

static int add_pieces(Piece **out, int *count, int *cap, char *host, CUdeviceptr dev, size_t len,
                      int device) {
    while (len > 0) {
        size_t n = PIECE - (size_t)((uintptr_t)host % PIECE); /* up to the next PIECE boundary */
        if (n > len) n = len;
        if (*count == *cap) {
            int grown = *cap ? 2 * *cap : 256;
            Piece *bigger = realloc(*out, sizeof(Piece) * (size_t)grown);
            if (!bigger) return 0;
            *out = bigger;
            *cap = grown;
        }
        char *page = (char *)((uintptr_t)host & ~(uintptr_t)4095);
        (*out)[(*count)++] = (Piece){page, (size_t)(host + n - page + 4095) / 4096 * 4096, host,
                                     dev, n, device, 0, 0};
        host += n;
        dev += n;
        len -= n;
    }
    return 1;
}

/* The pieces reordered so that the cards take turns: the first piece of each card, then the
 * second of each, and so on, each card's own pieces in their order. In segment order a model
 * split over two cards had all of one card's pieces taken before any of the other's, so the
 * copies used one card's link at a time. Every piece's device is valid here (context_of). */
static Piece *cards_in_turn(Piece *piece, int count) {
    Piece *out = malloc(sizeof(Piece) * (size_t)(count ? count : 1));
    if (!out) return NULL;
    int scan[MAX_DEVICES] = {0}, n = 0;
    while (n < count)
        for (int d = 0; d < MAX_DEVICES; d++) {
            while (scan[d] < count && piece[scan[d]].device != d) scan[d]++;
            if (scan[d] < count) out[n++] = piece[scan[d]++];
        }
    return out;
}

/* How many copying threads: INFINIJUP_VMM_COPIERS if it names 1 to MAX_COPIERS, else COPIERS
 * (one thread takes the pieces strictly in order: the tests read that order). Read once, as
 * the library is loaded: a getenv during a copy could race with the kernel's own threads
 * changing the environment. */
static int copiers = COPIERS;

__attribute__((constructor)) static void read_copiers(void) {
    const char *v = getenv("INFINIJUP_VMM_COPIERS");
    char *end = NULL;
    long n = v ? strtol(v, &end, 10) : 0;
    if (v && end != v && *end == 0 && n >= 1 && n <= MAX_COPIERS) copiers = (int)n;
}

/* Copy every segment on the GPU out into base, at its offset (to_host: its copy list, live
 * ranges, or all of it), or every segment just mapped again back from base (its live ranges, or
 * all of it). Nothing is released or unmapped here. Returns the first piece's failure, with
 * *moved the bytes of the pieces taken before it. */
static CUresult copy_pieces(char *base, int to_host, long long *moved) {
    Piece *piece = NULL;
    int count = 0, cap = 0;
    for (Segment *s = segments; s; s = s->next) {
        if (to_host ? !s->mapped : !(s->mapped && s->in_file)) continue;
        size_t one[2] = {0, s->size};
        size_t *r = s->live ? s->live : one;
        int n = s->live ? s->nlive : 1;
        if (to_host && copy_given) {
            r = s->copy;
            n = s->ncopy;
        }
        for (int i = 0; i < n; i++)
            if (!add_pieces(&piece, &count, &cap, base + s->offset + r[2 * i], s->ptr + r[2 * i],
                            r[2 * i + 1], s->device)) {
                free(piece);
                return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
            }
    }
    for (int i = 0; i < count; i++) /* every device's context, before the threads read them */
        if (!context_of(piece[i].device)) {
            free(piece);
            return 201; /* CUDA_ERROR_INVALID_CONTEXT */
        }
    Piece *turns = cards_in_turn(piece, count);
    free(piece);
    if (!turns) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    piece = turns;
    CUcontext caller = current_context();
    Plan plan = {piece, count, 0, 0, to_host, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                 {0}};
    pthread_t threads[MAX_COPIERS];
    int started = 0;
    for (int t = 0; t < copiers && t < count; t++)
        if (pthread_create(&threads[t], NULL, copy_thread, &plan) == 0) started++;
    if (started == 0 && count > 0) copy_thread(&plan); /* no thread could start: all here */
    CUresult res = 0;
    double t0 = now_s();
    for (int i = 0; i < count; i++) {
        pthread_mutex_lock(&plan.m);
        while (!piece[i].done) pthread_cond_wait(&plan.c, &plan.m);
        pthread_mutex_unlock(&plan.m);
        if (piece[i].res != 0 && res == 0) res = piece[i].res;
        if (res == 0) *moved += (long long)piece[i].len;
    }
    spent[0] += now_s() - t0;
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
    for (int k = 1; k < 5; k++) spent[k] += plan.spent[k];
    set_context(caller); /* the caller's context, as it was */
    free(piece);
    return res;
}

/* Give the file's pages back where a segment holds nothing live (1 MiB or more): dead bytes
 * cost no RAM in the arena, and read as zeros (a hole) when the store takes the file in. */
static void punch_dead(int fd, Segment *s) {
    if (!s->live) return;
    size_t at = 0;
    for (int i = 0; i <= s->nlive; i++) {
        size_t next = i < s->nlive ? s->live[2 * i] : s->size;
        if (next > at && next - at >= (1 << 20)) {
            size_t from = (s->offset + at + 4095) / 4096 * 4096;
            size_t to = (s->offset + next) / 4096 * 4096;
            if (to > from)
                fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)from,
                          (off_t)(to - from));
        }
        if (i < s->nlive) at = s->live[2 * i] + s->live[2 * i + 1];
    }
}

/* Allocate the file's pages a copy will write, before it writes any: a tmpfs past its quota,
 * or a host short of memory, answers ENOSPC or ENOMEM here, where a page faulted in during the
 * copy would be a SIGBUS (or the OOM killer) in the kernel. 0, or the errno (a filesystem
 * without fallocate reserves nothing: as before). */
static int reserve_range(int fd, size_t off, size_t len) {
    if (len == 0 || fallocate(fd, 0, (off_t)off, (off_t)len) == 0) return 0;
    return errno == EOPNOTSUPP ? 0 : errno;
}

static int reserve(int fd, const Segment *s) {
    if (!s->live) return reserve_range(fd, s->offset, s->size);
    for (int i = 0; i < s->nlive; i++) {
        int err = reserve_range(fd, s->offset + s->live[2 * i], s->live[2 * i + 1]);
        if (err) return err;
    }
    return 0;
}

/* Give the file's pages back between the segments on the GPU (where segments freed since an
 * earlier snapshot were). */
static void punch_gaps(int fd, size_t end) {
    size_t at = 0;
    for (;;) {
        size_t next = end; /* the first segment at or after `at` */
        const Segment *first = NULL;
        for (const Segment *s = segments; s; s = s->next)
            if (s->mapped && s->offset >= at && s->offset < next) { next = s->offset; first = s; }
        size_t from = (at + 4095) / 4096 * 4096, to = next / 4096 * 4096;
        if (to > from)
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)from, (off_t)(to - from));
        if (!first) return;
        at = first->offset + first->size;
    }
}

/* Like ij_sleep, but into the file `fd`: each segment at its offset (kept from the last time,
 * place_segments), the file as long as the last segment's end, nothing kept between them.
 * Every segment is copied out (copy_pieces) before any is released. Returns the bytes moved,
 * or -1 (then every segment is still on the GPU). The copy list of ij_set_copy is forgotten
 * either way. */
long long ij_sleep_into(int fd) {
    long long moved = 0;
    if (!load()) return -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 5; i++) spent[i] = 0;
    int any = 0;
    for (Segment *s = segments; s; s = s->next) any |= s->mapped;
    if (!any) { copy_given = 0; pthread_mutex_unlock(&lock); return 0; }
    size_t end = place_segments();
    struct stat st;
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size != end && ftruncate(fd, (off_t)end) != 0))
        goto fail_locked;
    if (!synchronize_devices()) goto fail_locked;
    punch_gaps(fd, end);
    for (Segment *s = segments; s; s = s->next)
        if (s->mapped) punch_dead(fd, s);
    last_errno = 0;
    for (Segment *s = segments; s && !last_errno; s = s->next)
        if (s->mapped) last_errno = reserve(fd, s);
    if (last_errno) goto fail_locked;
    char *base = map_file(fd, end, 1);
    if (!base) goto fail_locked;
    CUresult res = copy_pieces(base, 1, &moved);
    if (res != 0) { last_error = res; unmap_file(base, end); goto fail_locked; }
    for (Segment *s = segments; s; s = s->next) {
        if (!s->mapped) continue;
        cu.unmap(s->ptr, s->size);
        cu.release(s->handle);
        s->mapped = 0;
        s->in_file = 1;
    }
    unmap_file(base, end);
    copy_given = 0;
    pthread_mutex_unlock(&lock);
    return moved;
fail_locked:
    copy_given = 0;
    pthread_mutex_unlock(&lock);
    return -1;
}

/* Map the segments ij_sleep_into moved again at their addresses, and fill them from the file
 * `fd` (the same file, or the copy a restore brought back). Returns the bytes moved, or -1
 * (-2: the file is shorter than the segments it should hold). A wake that failed can be called
 * again: the segments it mapped stay marked in the file until every one is filled. */
long long ij_wake_from(int fd) {
    long long moved = 0;
    size_t need = 0;
    if (!load()) return -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 5; i++) spent[i] = 0;
    for (Segment *s = segments; s; s = s->next)
        if (s->in_file && s->offset + s->size > need) need = s->offset + s->size;
    if (need == 0) { pthread_mutex_unlock(&lock); return 0; }
    struct stat st;
    if (fstat(fd, &st) != 0) goto fail_locked;
    if ((size_t)st.st_size < need) { pthread_mutex_unlock(&lock); return -2; }
    char *base = map_file(fd, need, 0);
    if (!base) goto fail_locked;
    CUcontext caller = current_context();
    for (Segment *s = segments; s; s = s->next) {
        if (s->mapped || !s->in_file) continue;
        if (!use_device(s->device) || !map_physical(s)) {
            set_context(caller);
            unmap_file(base, need);
            goto fail_locked;
        }
    }
    set_context(caller);
    CUresult res = copy_pieces(base, 0, &moved);
    unmap_file(base, need);
    if (res != 0) { last_error = res; goto fail_locked; }
    for (Segment *s = segments; s; s = s->next)
        if (s->mapped) s->in_file = 0;
    pthread_mutex_unlock(&lock);
    return moved;
fail_locked:
    pthread_mutex_unlock(&lock);
    return -1;
}

int ij_last_errno(void) { return last_errno; }
