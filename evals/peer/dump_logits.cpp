// dump_logits: run llama.cpp on a GGUF over given token ids and print every position's logits.
// Usage: dump_logits MODEL.gguf OUT.f32 ID [ID ...]
// Decodes the ids as one prompt (one batch, every position's logits kept) on the CPU, 1 thread
// (deterministic), and writes n_ids x n_vocab float32 values to OUT.f32, row-major.
// Built by evals/peer/check_logits.py against a llama.cpp build tree.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 ID [ID ...]\n", argv[0]); return 2; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    std::vector<llama_token> ids;
    for (int i = 3; i < argc; i++) ids.push_back((llama_token) atoi(argv[i]));
    const int n = (int) ids.size();
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + 16; cp.n_batch = n; cp.n_ubatch = n; cp.n_threads = 1; cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(argv[2], "wb");
    if (!f) { fprintf(stderr, "cannot write %s\n", argv[2]); return 1; }
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    fclose(f);
    printf("%d positions x %d logits\n", n, n_vocab);
    llama_batch_free(batch); llama_free(ctx); llama_model_free(model);
    return 0;
}
