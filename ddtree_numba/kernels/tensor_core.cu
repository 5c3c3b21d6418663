// The only CUDA C++ of ddtree_numba: warp-level tensor-core instructions that numba-cuda cannot
// spell (it has no inline PTX). Each function is a few lines around one PTX instruction; numba
// kernels call them through cuda.declare_device (kernels/tensor_core.py) and link-time
// optimisation inlines them, so they cost nothing beyond their instruction.
//
// Conventions: C ABI (extern "C", values returned directly); results of more than one register
// are written through a pointer to a numba local array (cffi ffi.from_buffer), which the
// optimiser keeps in registers once the call is inlined. Shared-memory operands are 32-bit
// shared-window addresses (shared_address() below), as the PTX instructions take them.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
// lane = 4 g + t (g = lane / 4 in 0..7, t = lane % 4 in 0..3); a register holds two 16-bit
// values, the lower column (or k) index in the low half. ddtree_numba.reference.mma_fragments
// is the numpy model of these maps, and the docs draw them from it.

typedef unsigned int u32;
typedef unsigned long long u64;

// mma_bf16_16816, ldmatrix_x4 and ldmatrix_x4_trans are warp-collective (.sync.aligned): all
// 32 lanes of a warp execute each call together, each lane passing its own operands/address.

// D = A B + C for one warp: A 16 x 16 (row-major), B 16 x 8 (column-major), C and D 16 x 8 in
// float32, accumulated in place in c[0..3].
//   A: a0 = A[g][2t, 2t+1]    a1 = A[g+8][2t, 2t+1]    a2 = A[g][2t+8, 2t+9]  a3 = A[g+8][2t+8, 2t+9]
//   B: b0 = B[2t, 2t+1][g]    b1 = B[2t+8, 2t+9][g]
//   C: c0, c1 = C[g][2t, 2t+1]                          c2, c3 = C[g+8][2t, 2t+1]
extern "C" __device__ void mma_bf16_16816(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                          u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same product with float16 inputs (same fragment layouts).
extern "C" __device__ void mma_f16_16816(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8 x 8 matrices of 16-bit values from shared memory. Lane l gives the address of row
// l % 8 of matrix l / 8 (16 contiguous bytes); matrix j lands in r[j]: lane 4 g + t holds
// row g, columns 2t and 2t+1 of it.
extern "C" __device__ void ldmatrix_x4(u32 *r, u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// As ldmatrix_x4, each matrix transposed on the way: lane 4 g + t holds rows 2t and 2t+1 of
// column g (the B operand of mma from a matrix stored with k along its rows).
extern "C" __device__ void ldmatrix_x4_trans(u32 *r, u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// The 32-bit shared-window address of a generic pointer into shared memory.
extern "C" __device__ u32 shared_address(const unsigned short *pointer) {
    u64 address;
    asm("cvta.to.shared.u64 %0, %1;\n" : "=l"(address) : "l"(pointer));
    return (u32)address;
}

// Copy 16 bytes from global to shared memory without passing through registers (sm_80+).
// src_bytes < 16 fills the rest with zeros; src_bytes = 0 writes 16 zero bytes and reads
// nothing (source + offset must still be an address inside the array: the kernel passes the
// base plus this thread's chunk offset).
extern "C" __device__ void cp_async_16(u32 address, const unsigned short *source, u64 offset,
                                       u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(address), "l"((const char *)source + offset), "r"(src_bytes)
                 : "memory");
}

// Close the group of cp.async issued so far by this thread.
extern "C" __device__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until every cp.async of this thread has landed.
extern "C" __device__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Wait until at most `pending` of this thread's most recent groups are still in flight (the
// older ones have landed). The PTX operand must be an immediate: call it with a constant, and
// the branches fold away once inlined. pending > 3 waits as for 3 (stricter, still correct).
extern "C" __device__ void cp_async_wait_pending(u32 pending) {
    if (pending == 0) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    } else if (pending == 1) {
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    } else if (pending == 2) {
        asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    } else {
        asm volatile("cp.async.wait_group 3;\n" ::: "memory");
    }
}

// Two float32 values rounded to the nearest 16-bit float (ties to even), packed: lo in the
// low half (the first PTX source operand goes to the upper half).
extern "C" __device__ u32 pack_bf16x2(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

extern "C" __device__ u32 pack_f16x2(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}
