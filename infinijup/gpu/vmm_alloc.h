/*
 * What the two halves of Infinijup's VMM allocator share (vmm_alloc.c: the driver, the
 * segments, their pinned host copies; vmm_arena.c: the segments into an arena file and back).
 * Built together into one library:
 *     cc -O2 -shared -fPIC -o libinfinijup_vmm.so vmm_alloc.c vmm_arena.c -ldl -lpthread
 */
#ifndef INFINIJUP_VMM_ALLOC_H
#define INFINIJUP_VMM_ALLOC_H
#include <pthread.h>
#include <stddef.h>

#define SHARED __attribute__((visibility("hidden"))) /* between the two files, not exported */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;
typedef void *CUcontext;
typedef int CUdevice;

typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;


typedef struct {
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*alloc_host)(void **, size_t);
    CUresult (*free_host)(void *);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*synchronize)(void);
    CUresult (*device_count)(int *);
    CUresult (*can_access_peer)(int *, CUdevice, CUdevice);
} Driver;

extern SHARED Driver cu;

typedef struct Segment {
    CUdeviceptr ptr;
    size_t size;   /* rounded up to the granularity */
    int device;
    CUmemHandle handle;
    int mapped;    /* 0 while asleep: the contents are in host */
    void *host;    /* pinned host copy while asleep */
    int in_file;   /* asleep in the file of ij_sleep_into, at offset */
    int placed;    /* offset given: the segment keeps it in every later file */
    size_t offset;
    size_t *live;  /* (start, length) pairs relative to ptr: what PyTorch has in use; NULL: all */
    int nlive;
    size_t *copy;  /* the next ij_sleep_into copies only these pairs (ij_set_copy) */
    int ncopy;
    struct Segment *next;
} Segment;

#define MAX_DEVICES 64

extern SHARED Segment *segments;      /* every segment, newest first */
extern SHARED pthread_mutex_t lock;   /* held while the segments are read or changed */
extern SHARED CUresult last_error;    /* the driver's answer to the last call that failed */
extern SHARED CUcontext device_ctx[MAX_DEVICES]; /* each device's primary context, once retained */

SHARED int load(void);                /* the driver opened: 1, or 0 */
SHARED CUcontext context_of(int device);
SHARED int use_device(int device);    /* `device`'s context current: 1, or 0 */
SHARED CUcontext current_context(void);
SHARED void set_context(CUcontext ctx);
SHARED int synchronize_devices(void);
SHARED int map_physical(Segment *s);  /* new physical memory under s: 1, or 0 */

#endif
