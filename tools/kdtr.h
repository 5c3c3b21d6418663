/* kdtr.h: a single-header C99 reader for KDTR files (ddtree_numba's golden fixtures).
 *
 * Layout (little-endian): a 16-byte header {"KDTR", u32 version = 1, u32 count, u32 0}, then
 * `count` 152-byte entries {char name[64]; u32 dtype; u32 rank; u64 shape[8]; u64 offset;
 * u64 nbytes}, then each tensor's bytes at its 64-aligned offset. See ddtree_numba/kdtr.py.
 *
 *   kdtr_file f;
 *   if (kdtr_open("case.kdtr", &f, err, sizeof err) != 0) { puts(err); return 1; }
 *   const kdtr_tensor *t = kdtr_find(&f, "tree.parents");
 *   ... t->data, t->dtype, t->rank, t->shape[], t->nbytes ...
 *   kdtr_close(&f);
 *
 * Every field is checked before use, as the Python reader does; a bad file gets an error
 * message, never an out-of-bounds read. Define KDTR_IMPLEMENTATION in one translation unit.
 * Assumes a little-endian host (x86-64, AArch64).
 */
#ifndef KDTR_H
#define KDTR_H

#include <stddef.h>
#include <stdint.h>

#define KDTR_MAX_RANK 8
#define KDTR_MAX_TENSORS 65536u
/* Largest product of a shape's non-zero extents times the itemsize (INT64_MAX), so that every
 * byte offset and stride of a tensor, even an empty one, fits an int64_t. */
#define KDTR_MAX_SPAN 0x7fffffffffffffffull

enum kdtr_dtype {
    KDTR_INT32 = 1, KDTR_INT64 = 2, KDTR_UINT8 = 3, KDTR_BOOL = 4, KDTR_UINT32 = 5,
    KDTR_FLOAT16 = 6, KDTR_BFLOAT16 = 7, KDTR_FLOAT32 = 8, KDTR_FLOAT64 = 9
};

typedef struct {
    char name[64];
    uint32_t dtype;
    uint32_t rank;
    uint64_t shape[KDTR_MAX_RANK];
    uint64_t nbytes;
    const void *data;          /* points into kdtr_file.bytes */
} kdtr_tensor;

typedef struct {
    unsigned char *bytes;      /* the whole file */
    size_t size;
    uint32_t count;
    kdtr_tensor *tensors;
} kdtr_file;

int kdtr_open(const char *path, kdtr_file *file, char *err, size_t err_size);
const kdtr_tensor *kdtr_find(const kdtr_file *file, const char *name);
size_t kdtr_itemsize(uint32_t dtype);   /* 0 for an unknown code */
void kdtr_close(kdtr_file *file);

#ifdef KDTR_IMPLEMENTATION
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t kdtr_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t kdtr_u64(const unsigned char *p) {
    return (uint64_t)kdtr_u32(p) | (uint64_t)kdtr_u32(p + 4) << 32;
}

size_t kdtr_itemsize(uint32_t dtype) {
    switch (dtype) {
    case KDTR_UINT8: case KDTR_BOOL: return 1;
    case KDTR_FLOAT16: case KDTR_BFLOAT16: return 2;
    case KDTR_INT32: case KDTR_UINT32: case KDTR_FLOAT32: return 4;
    case KDTR_INT64: case KDTR_FLOAT64: return 8;
    default: return 0;
    }
}

static int kdtr_fail(kdtr_file *file, char *err, size_t err_size, const char *message) {
    snprintf(err, err_size, "%s", message);
    kdtr_close(file);
    return -1;
}

static int kdtr_name_ok(const char *name) {
    size_t n = strlen(name);
    if (n == 0 || n > 63) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                 c == '_' || c == '.' || c == '-';
        if (!ok) return 0;
    }
    return 1;
}

int kdtr_open(const char *path, kdtr_file *file, char *err, size_t err_size) {
    memset(file, 0, sizeof *file);
    FILE *f = fopen(path, "rb");
    if (!f) return kdtr_fail(file, err, err_size, "cannot open the file");
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return kdtr_fail(file, err, err_size, "seek"); }
    long end = ftell(f);
    rewind(f);
    if (end < 16) { fclose(f); return kdtr_fail(file, err, err_size, "truncated header"); }
    file->size = (size_t)end;
    file->bytes = (unsigned char *)malloc(file->size);
    if (!file->bytes || fread(file->bytes, 1, file->size, f) != file->size) {
        fclose(f);
        return kdtr_fail(file, err, err_size, "cannot read the file");
    }
    fclose(f);
    const unsigned char *b = file->bytes;
    if (memcmp(b, "KDTR", 4) != 0) return kdtr_fail(file, err, err_size, "bad magic");
    if (kdtr_u32(b + 4) != 1) return kdtr_fail(file, err, err_size, "unknown version");
    file->count = kdtr_u32(b + 8);
    if (file->count > KDTR_MAX_TENSORS) return kdtr_fail(file, err, err_size, "too many tensors");
    uint64_t dir_end = 16 + 152ull * file->count;
    if (dir_end > file->size) return kdtr_fail(file, err, err_size, "truncated directory");
    uint64_t data_start = (dir_end + 63) / 64 * 64;
    file->tensors = (kdtr_tensor *)calloc(file->count ? file->count : 1, sizeof(kdtr_tensor));
    if (!file->tensors) return kdtr_fail(file, err, err_size, "out of memory");
    for (uint32_t k = 0; k < file->count; k++) {
        const unsigned char *e = b + 16 + 152ull * k;
        kdtr_tensor *t = &file->tensors[k];
        memcpy(t->name, e, 64);
        if (t->name[63] != '\0' || !kdtr_name_ok(t->name))
            return kdtr_fail(file, err, err_size, "bad tensor name");
        for (size_t i = strlen(t->name); i < 64; i++)
            if (t->name[i] != '\0') return kdtr_fail(file, err, err_size, "bytes after a name");
        t->dtype = kdtr_u32(e + 64);
        t->rank = kdtr_u32(e + 68);
        size_t item = kdtr_itemsize(t->dtype);
        if (item == 0) return kdtr_fail(file, err, err_size, "unknown dtype code");
        if (t->rank > KDTR_MAX_RANK) return kdtr_fail(file, err, err_size, "rank > 8");
        uint64_t elems = 1, span = item;        /* span: bytes of the non-zero extents */
        for (uint32_t i = 0; i < KDTR_MAX_RANK; i++) {
            t->shape[i] = kdtr_u64(e + 72 + 8 * i);
            if (i >= t->rank) {
                if (t->shape[i] != 0) return kdtr_fail(file, err, err_size, "shape past rank");
                continue;
            }
            if (t->shape[i] != 0) {
                if (t->shape[i] > KDTR_MAX_SPAN / span)
                    return kdtr_fail(file, err, err_size, "shape too large");
                span *= t->shape[i];
            }
            if (t->shape[i] != 0 && elems > (uint64_t)file->size / t->shape[i])
                return kdtr_fail(file, err, err_size, "shape larger than the file");
            elems *= t->shape[i];
        }
        if (elems > (uint64_t)file->size / item)
            return kdtr_fail(file, err, err_size, "shape larger than the file");
        uint64_t offset = kdtr_u64(e + 136);
        t->nbytes = kdtr_u64(e + 144);
        if (t->nbytes != elems * item) return kdtr_fail(file, err, err_size, "nbytes mismatch");
        if (offset % 64 != 0) return kdtr_fail(file, err, err_size, "unaligned offset");
        if (offset < data_start || offset > file->size || t->nbytes > file->size - offset)
            return kdtr_fail(file, err, err_size, "data outside the file");
        t->data = b + offset;
        for (uint32_t j = 0; j < k; j++) {      /* duplicates and overlaps: O(count^2) */
            const kdtr_tensor *o = &file->tensors[j];
            if (strcmp(o->name, t->name) == 0)
                return kdtr_fail(file, err, err_size, "duplicate name");
            const unsigned char *a0 = (const unsigned char *)o->data, *b0 = b + offset;
            if (o->nbytes && t->nbytes && a0 < b0 + t->nbytes && b0 < a0 + o->nbytes)
                return kdtr_fail(file, err, err_size, "overlapping tensors");
        }
    }
    return 0;
}

const kdtr_tensor *kdtr_find(const kdtr_file *file, const char *name) {
    for (uint32_t k = 0; k < file->count; k++)
        if (strcmp(file->tensors[k].name, name) == 0) return &file->tensors[k];
    return NULL;
}

void kdtr_close(kdtr_file *file) {
    free(file->tensors);
    free(file->bytes);
    memset(file, 0, sizeof *file);
}
#endif /* KDTR_IMPLEMENTATION */
#endif /* KDTR_H */
