/* The DLPack 0.8 ABI (dlpack.h), for Tensor.__dlpack__ (tensor.pxi).

   Why ours: DLPack is a header-only ABI that other libraries (numpy, torch)
   read by layout, and no dlpack.h comes with Python or ggml. Only the structs
   the exporter fills are here, under ggmlpy_ names so that they cannot clash
   with a real dlpack.h included elsewhere. */
#ifndef GGMLPY_DLPACK_H
#define GGMLPY_DLPACK_H

typedef struct { int device_type; int device_id; } ggmlpy_DLDevice;
typedef struct { unsigned char code; unsigned char bits; unsigned short lanes; } ggmlpy_DLDataType;
typedef struct {
    void * data; ggmlpy_DLDevice device; int ndim; ggmlpy_DLDataType dtype;
    long long * shape; long long * strides; unsigned long long byte_offset;
} ggmlpy_DLTensor;
typedef struct ggmlpy_DLManagedTensor {
    ggmlpy_DLTensor dl_tensor; void * manager_ctx;
    void (*deleter)(struct ggmlpy_DLManagedTensor * self);
} ggmlpy_DLManagedTensor;

#endif /* GGMLPY_DLPACK_H */
