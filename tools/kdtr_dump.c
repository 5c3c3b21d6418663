/* kdtr_dump FILE [OUTDIR]: list the tensors of a KDTR file; with OUTDIR, also write each
 * tensor's raw bytes to OUTDIR/NAME.bin (the test compares them with numpy, bit for bit). */
#define KDTR_IMPLEMENTATION
#include "kdtr.h"

#include <stdio.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: kdtr_dump FILE [OUTDIR]\n");
        return 2;
    }
    kdtr_file f;
    char err[256];
    if (kdtr_open(argv[1], &f, err, sizeof err) != 0) {
        fprintf(stderr, "kdtr_dump: %s: %s\n", argv[1], err);
        return 1;
    }
    for (uint32_t k = 0; k < f.count; k++) {
        const kdtr_tensor *t = &f.tensors[k];
        printf("%s %u %u", t->name, t->dtype, t->rank);
        for (uint32_t i = 0; i < t->rank; i++) printf(" %llu", (unsigned long long)t->shape[i]);
        printf("\n");
        if (argc > 2) {
            char path[1024];
            snprintf(path, sizeof path, "%s/%s.bin", argv[2], t->name);
            FILE *out = fopen(path, "wb");
            if (!out || fwrite(t->data, 1, t->nbytes, out) != t->nbytes) {
                fprintf(stderr, "kdtr_dump: cannot write %s\n", path);
                kdtr_close(&f);
                return 1;
            }
            fclose(out);
        }
    }
    kdtr_close(&f);
    return 0;
}
