/*
 * A stand-in for the CUDA driver (libcuda.so.1) in host memory, for the VMM allocator's copy
 * logic on a machine without a GPU (tests/gpu/test_vmm_copy.py). "Device" memory is host
 * memory: cuMemCreate makes a memfd, cuMemMap maps it at the reserved address, cuMemUnmap puts
 * an inaccessible mapping back, so a byte read of a released segment faults as on the GPU.
 * It checks what the real driver would refuse: a copy needs the context of the device whose
 * memory it touches to be current in the calling thread. fake_fail_copy_at(n) makes the n-th
 * copy from now fail; fake_host_live() counts page-locked host allocations not yet freed;
 * fake_copy_log(device, bytes, max) gives the device and length of each copy since the last
 * call (the first `max`).
 *     cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_libcuda.c -lpthread
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

#define DEVICES 2
#define GRANULARITY (2u << 20)
#define RANGES 4096

static char contexts[DEVICES]; /* a context is the address of its device's byte */
static __thread CUcontext current;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uintptr_t start; size_t len; int device; } ranges[RANGES]; /* mapped memory */
static long copies_left = -1; /* fake_fail_copy_at: copies before the failing one; -1: none */
static long host_live;

#define LOG 4096
static int log_device[LOG];
static size_t log_bytes[LOG];
static long logged;

long fake_copy_log(int *device, size_t *bytes, long max) {
    pthread_mutex_lock(&lock);
    long n = logged < max ? logged : max;
    memcpy(device, log_device, sizeof(int) * (size_t)n);
    memcpy(bytes, log_bytes, sizeof(size_t) * (size_t)n);
    logged = 0;
    pthread_mutex_unlock(&lock);
    return n;
}

void fake_fail_copy_at(long n) { __atomic_store_n(&copies_left, n - 1, __ATOMIC_SEQ_CST); }
long fake_host_live(void) { return __atomic_load_n(&host_live, __ATOMIC_SEQ_CST); }

CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return 0; }
CUresult cuCtxSynchronize(void) { return current ? 0 : 201; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal < DEVICES ? 0 : 101; }
CUresult cuDeviceGetCount(int *n) { *n = DEVICES; return 0; }
CUresult cuDeviceCanAccessPeer(int *can, int a, int b) { *can = a != b; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, int dev) {
    if (dev < 0 || dev >= DEVICES) return 101;
    *c = &contexts[dev];
    return 0;
}

typedef struct { int type, handles; struct { int type, id; } location; } Prop; /* its head */

CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop; (void)option;
    *g = GRANULARITY;
    return 0;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr hint,
                             unsigned long long flags) {
    (void)align; (void)hint; (void)flags;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 2;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return 0;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? 0 : 1;
}

/* A handle is a memfd with the device in its top bits. */
CUresult cuMemCreate(unsigned long long *handle, size_t size, const void *prop,
                     unsigned long long flags) {
    (void)flags;
    int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    if (fd < 0) return 2;
    if (ftruncate(fd, (off_t)size) != 0) { close(fd); return 2; }
    *handle = (unsigned long long)fd | ((unsigned long long)((const Prop *)prop)->location.id << 32);
    return 0;
}

CUresult cuMemRelease(unsigned long long handle) { return close((int)(handle & 0xffffffff)); }

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long handle,
                  unsigned long long flags) {
    (void)flags;
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   (int)(handle & 0xffffffff), (off_t)offset);
    if (p == MAP_FAILED) return 2;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < RANGES; i++)
        if (!ranges[i].len) {
            ranges[i].start = (uintptr_t)ptr;
            ranges[i].len = size;
            ranges[i].device = (int)(handle >> 32);
            break;
        }
    pthread_mutex_unlock(&lock);
    return 0;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    (void)desc; (void)count;
    return mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0 ? 0 : 1;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < RANGES; i++)
        if (ranges[i].len && ranges[i].start == (uintptr_t)ptr) ranges[i].len = 0;
    pthread_mutex_unlock(&lock);
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? 1 : 0;
}

CUresult cuMemAllocHost_v2(void **p, size_t size) {
    if (!current) return 201;
    if (posix_memalign(p, 4096, size) != 0) return 2;
    __atomic_add_fetch(&host_live, 1, __ATOMIC_SEQ_CST);
    return 0;
}

CUresult cuMemFreeHost(void *p) {
    free(p);
    __atomic_sub_fetch(&host_live, 1, __ATOMIC_SEQ_CST);
    return 0;
}

/* 0 when [dev, dev + len) is mapped memory of the current context's device. */
static CUresult reachable(CUdeviceptr dev, size_t len) {
    if (!current) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    int device = (int)((char *)current - contexts);
    CUresult res = 1; /* CUDA_ERROR_INVALID_VALUE */
    pthread_mutex_lock(&lock);
    for (int i = 0; i < RANGES; i++)
        if (ranges[i].len && ranges[i].start <= dev && dev + len <= ranges[i].start + ranges[i].len)
            res = ranges[i].device == device ? 0 : 1;
    if (res == 0 && logged < LOG) {
        log_device[logged] = device;
        log_bytes[logged++] = len;
    }
    pthread_mutex_unlock(&lock);
    if (res == 0 && __atomic_fetch_sub(&copies_left, 1, __ATOMIC_SEQ_CST) == 0) res = 999;
    return res;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len) {
    CUresult res = reachable(src, len);
    if (res == 0) memcpy(dst, (void *)(uintptr_t)src, len);
    return res;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t len) {
    CUresult res = reachable(dst, len);
    if (res == 0) memcpy((void *)(uintptr_t)dst, src, len);
    return res;
}
