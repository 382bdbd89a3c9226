/*
 * Infinijup's CUDA allocator for PyTorch (issue 13, first step): segments backed by CUDA
 * virtual memory management, so that a snapshot can move their contents to host memory at
 * copy-engine speed and give the physical memory back, and a wake can map it again at the same
 * virtual addresses (every tensor pointer stays valid).
 *
 * PyTorch calls ij_malloc / ij_free through torch.cuda.memory.CUDAPluggableAllocator, under its
 * caching allocator (a MemPool): they see segments, not tensors. ij_sleep / ij_wake / ij_stats
 * are called from Python (ctypes) while the kernel is quiesced; a snapshot's way, into an arena
 * file and back, is in vmm_arena.c.
 *
 * No CUDA headers are needed to build it: the few driver types are declared in vmm_alloc.h and
 * the driver is opened with dlopen, so it builds on a machine without CUDA:
 *     cc -O2 -shared -fPIC -o libinfinijup_vmm.so vmm_alloc.c vmm_arena.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "vmm_alloc.h"

Driver cu;
Segment *segments;
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
CUresult last_error;
CUcontext device_ctx[MAX_DEVICES];
static int keep_host; /* keep the pinned copies after a wake: the next sleep only copies */
static int loaded = -1;

int load(void) {
    if (loaded >= 0) return loaded;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    loaded = 0;
    if (!lib) return 0;
#define SYM(field, name) if (!(*(void **)&cu.field = dlsym(lib, name))) return 0
    SYM(ctx_get_current, "cuCtxGetCurrent");
    SYM(ctx_set_current, "cuCtxSetCurrent");
    SYM(device_get, "cuDeviceGet");
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(granularity, "cuMemGetAllocationGranularity");
    SYM(address_reserve, "cuMemAddressReserve");
    SYM(address_free, "cuMemAddressFree");
    SYM(create, "cuMemCreate");
    SYM(release, "cuMemRelease");
    SYM(map, "cuMemMap");
    SYM(unmap, "cuMemUnmap");
    SYM(set_access, "cuMemSetAccess");
    SYM(alloc_host, "cuMemAllocHost_v2");
    SYM(free_host, "cuMemFreeHost");
    SYM(dtoh, "cuMemcpyDtoH_v2");
    SYM(htod, "cuMemcpyHtoD_v2");
    SYM(synchronize, "cuCtxSynchronize");
    SYM(device_count, "cuDeviceGetCount");
    SYM(can_access_peer, "cuDeviceCanAccessPeer");
#undef SYM
    loaded = 1;
    return 1;
}

#define CHECK(call) do { CUresult r_ = (call); if (r_ != 0) { last_error = r_; goto fail; } } while (0)

static int ensure_context(int device) {
    CUcontext ctx = 0;
    if (cu.ctx_get_current(&ctx) == 0 && ctx) return 1;
    CUdevice dev;
    if (cu.device_get(&dev, device) != 0 || cu.primary_ctx_retain(&ctx, dev) != 0) return 0;
    return cu.ctx_set_current(ctx) == 0;
}

/* Several GPUs (issue 33): the primary context of each device a segment lives on, retained
 * once. Copies and synchronizations of a segment run in its own device's context, so each
 * card's copy engine moves its own bytes. */
CUcontext context_of(int device) {
    if (device < 0 || device >= MAX_DEVICES) return 0;
    if (!device_ctx[device]) {
        CUdevice dev;
        CUcontext ctx = 0;
        if (cu.device_get(&dev, device) != 0 || cu.primary_ctx_retain(&ctx, dev) != 0) return 0;
        device_ctx[device] = ctx;
    }
    return device_ctx[device];
}

/* Make `device`'s context current (0 on failure). */
int use_device(int device) {
    CUcontext want = context_of(device), now = 0;
    if (!want) return 0;
    if (cu.ctx_get_current(&now) == 0 && now == want) return 1;
    return cu.ctx_set_current(want) == 0;
}

CUcontext current_context(void) {
    CUcontext ctx = 0;
    return cu.ctx_get_current(&ctx) == 0 ? ctx : 0;
}

void set_context(CUcontext ctx) {
    if (ctx) cu.ctx_set_current(ctx);
}

/* Finish the queued work of every device a mapped segment lives on; the caller's context is
 * current again afterwards. 0 on failure. */
int synchronize_devices(void) {
    CUcontext caller = 0;
    cu.ctx_get_current(&caller);
    int done[MAX_DEVICES] = {0}, ok = 1;
    for (Segment *s = segments; s && ok; s = s->next) {
        if (!s->mapped || s->device < 0 || s->device >= MAX_DEVICES || done[s->device]) continue;
        done[s->device] = 1;
        ok = use_device(s->device) && cu.synchronize() == 0;
    }
    if (caller) cu.ctx_set_current(caller);
    return ok;
}

static CUmemAllocationProp prop_for(int device) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = device;
    return prop;
}

/* Back [ptr, ptr + size) with new physical memory of `device`, read-write for it and for every
 * other device that can reach it (peer access: a kernel that copies between cards, or a layer
 * on one card reading a tensor on another, as PyTorch does once peers are enabled). */
int map_physical(Segment *s) {
    CUmemAllocationProp prop = prop_for(s->device);
    CUmemAccessDesc access[MAX_DEVICES];
    size_t naccess = 0;
    int count = 0;
    access[naccess++] = (CUmemAccessDesc){{1, s->device}, 3};
    if (cu.device_count(&count) != 0) count = 0;
    CUdevice owner;
    if (count > 1 && cu.device_get(&owner, s->device) == 0)
        for (int d = 0; d < count && d < MAX_DEVICES; d++) {
            CUdevice peer;
            int can = 0;
            if (d != s->device && cu.device_get(&peer, d) == 0 &&
                cu.can_access_peer(&can, peer, owner) == 0 && can)
                access[naccess++] = (CUmemAccessDesc){{1, d}, 3};
        }
    CHECK(cu.create(&s->handle, s->size, &prop, 0));
    if (cu.map(s->ptr, s->size, 0, s->handle, 0) != 0) {
        cu.release(s->handle);
        goto fail;
    }
    if (cu.set_access(s->ptr, s->size, access, naccess) != 0 &&
        (naccess == 1 || cu.set_access(s->ptr, s->size, access, 1) != 0)) { /* peers refused */
        cu.unmap(s->ptr, s->size);
        cu.release(s->handle);
        goto fail;
    }
    s->mapped = 1;
    return 1;
fail:
    return 0;
}

/* Called when the GPU has no room for a segment (issue 27): the kernel asks the server to make
 * room (release idle kernels); nonzero means "try once more". Set from Python (vmm.py). */
static int (*on_short)(size_t bytes, int device) = NULL;

void ij_set_on_short(int (*fn)(size_t, int)) { on_short = fn; }

void *ij_malloc(ssize_t size, int device, void *stream) {
    (void)stream;
    if (!load() || !ensure_context(device)) return NULL;
    CUmemAllocationProp prop = prop_for(device);
    size_t gran = 0;
    if (cu.granularity(&gran, &prop, 0) != 0 || gran == 0) return NULL;
    Segment *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->size = ((size_t)size + gran - 1) / gran * gran;
    s->device = device;
    CHECK(cu.address_reserve(&s->ptr, s->size, gran, 0, 0));
    if (!map_physical(s) && !(on_short && on_short(s->size, device) && map_physical(s))) {
        cu.address_free(s->ptr, s->size);
        goto fail;
    }
    pthread_mutex_lock(&lock);
    s->next = segments;
    segments = s;
    pthread_mutex_unlock(&lock);
    return (void *)(uintptr_t)s->ptr;
fail:
    free(s);
    return NULL;
}

void ij_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    pthread_mutex_lock(&lock);
    Segment **at = &segments;
    while (*at && (*at)->ptr != (CUdeviceptr)(uintptr_t)ptr) at = &(*at)->next;
    Segment *s = *at;
    if (s) *at = s->next;
    pthread_mutex_unlock(&lock);
    if (!s) return;
    if (s->mapped) {
        cu.unmap(s->ptr, s->size);
        cu.release(s->handle);
    }
    if (s->host) cu.free_host(s->host);
    cu.address_free(s->ptr, s->size);
    free(s->live);
    free(s->copy);
    free(s);
}

/* Copy every segment to pinned host memory and give its physical memory back; the virtual
 * addresses stay reserved. Returns the bytes moved, or -1 (error in ij_last_error; segments
 * already moved stay asleep, the others stay on the GPU: ij_wake brings back what slept). */
long long ij_sleep(void) {
    long long moved = 0;
    if (!load()) return -1;
    CUcontext caller = current_context();
    pthread_mutex_lock(&lock);
    if (!synchronize_devices()) goto fail_locked;
    for (Segment *s = segments; s; s = s->next) {
        if (!s->mapped) continue;
        if (!use_device(s->device)) goto fail_locked;
        if (!s->host && cu.alloc_host(&s->host, s->size) != 0) { s->host = NULL; goto fail_locked; }
        if (cu.dtoh(s->host, s->ptr, s->size) != 0) goto fail_locked;
        cu.unmap(s->ptr, s->size);
        cu.release(s->handle);
        s->mapped = 0;
        moved += (long long)s->size;
    }
    set_context(caller);
    pthread_mutex_unlock(&lock);
    return moved;
fail_locked:
    set_context(caller);
    pthread_mutex_unlock(&lock);
    return -1;
}

/* Map every sleeping segment again at its address and copy its contents back. */
long long ij_wake(void) {
    long long moved = 0;
    if (!load()) return -1;
    CUcontext caller = current_context();
    pthread_mutex_lock(&lock);
    for (Segment *s = segments; s; s = s->next) {
        if (s->mapped || s->in_file) continue; /* (asleep in a file: ij_wake_from) */
        if (!use_device(s->device) || !map_physical(s)) goto fail_locked;
        if (cu.htod(s->ptr, s->host, s->size) != 0) goto fail_locked;
        if (!keep_host) {
            cu.free_host(s->host);
            s->host = NULL;
        }
        moved += (long long)s->size;
    }
    set_context(caller);
    pthread_mutex_unlock(&lock);
    return moved;
fail_locked:
    set_context(caller);
    pthread_mutex_unlock(&lock);
    return -1;
}

/* Segments and bytes: in total, on the GPU now, and whose contents are in an arena file, not
 * (all) on the GPU (asleep, or mapped again by a wake that failed before it filled them). */
void ij_stats(long long *count, long long *bytes, long long *mapped_bytes,
              long long *in_file_bytes) {
    long long n = 0, b = 0, m = 0, f = 0;
    pthread_mutex_lock(&lock);
    for (Segment *s = segments; s; s = s->next) {
        n++;
        b += (long long)s->size;
        if (s->mapped) m += (long long)s->size;
        if (s->in_file) f += (long long)s->size;
    }
    pthread_mutex_unlock(&lock);
    *count = n; *bytes = b; *mapped_bytes = m; *in_file_bytes = f;
}

int ij_last_error(void) { return last_error; }

/* 1: pinned host copies stay allocated after a wake (host memory holds a second copy of the
 * GPU memory, and later sleeps skip pinning); 0: they are freed at each wake. */
void ij_keep_host(int keep) { keep_host = keep; }
