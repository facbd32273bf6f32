//! llama_ref: a small llama.cpp reference driver for stage-server's agreement fixtures and model benchmark.
//
// Uses only llama.cpp's public C API (llama.h, ggml-backend.h) against the prebuilt libraries shipped by the npm
// package node-llama-cpp. Built by `cargo xtask llama-ref build`. Two modes:
//
//   llama_ref --backends DIR --model FILE [--threads N] run (--prompt TEXT | --ids 1,2,3) [--generate N]
//             [--logits-out FILE]
//     Greedy-generates N tokens after the prompt (end-of-generation tokens do not stop it, so every run yields
//     exactly N), then, when --logits-out is given, clears the cache and teacher-forces the whole stream
//     (prompt + generated) in one batch with logits requested at every position, writing them as a row-major
//     little-endian f32 matrix [stream length x vocabulary]. `--ids S --generate 0 --logits-out F` therefore
//     teacher-forces any given stream S. Prints one JSON object: variant, vocabulary size, prompt and generated ids,
//     and the top-2 logit margin of every greedy step (as decoded incrementally, which can differ slightly from
//     the teacher-forced batch).
//
//   With --dump-dir DIR, the teacher-forced evaluation also writes every contiguous f32 intermediate tensor that
//   llama.cpp's graph names (through the context's eval callback: "attn_norm-0", "Qcur-0", "kqv_out-0", "l_out-0",
//   ..., "result_norm", "result_output") to DIR/<name>.f32 as raw little-endian f32 in ggml order (the first
//   dimension varies fastest), and lists them in DIR/index.txt as `name ne0 ne1 ne2 ne3`. A name the graph uses
//   twice gets a `#2`, `#3`, ... suffix. This is how our forward is compared with llama.cpp's layer by layer.
//
//   llama_ref --backends DIR --model FILE [--threads N] bench [--pp 128] [--tg 64] [--repeats 5]
//     llama-bench-style timing: one warm-up, then per repeat a prompt of pp tokens decoded as one batch from an
//     empty cache, and tg tokens decoded one at a time from an empty cache. Prints one JSON object with the
//     tokens/s of every repeat.
//
// The CPU backend is loaded from DIR with ggml_backend_load_all_from_path, which picks the best-scoring
// libggml-cpu-*.so there; a folder holding a single variant forces it. The chosen variant is read back from
// /proc/self/maps and printed, because a speed quoted against llama.cpp means little without it.

#include "ggml-backend.h"
#include "llama.h"

#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

static bool verbose = false;

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (verbose || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

[[noreturn]] static void fail(const std::string & message) {
    fprintf(stderr, "llama_ref: %s\n", message.c_str());
    exit(1);
}

// The file name stem of the loaded CPU backend ("sapphirerapids", "haswell", ...), from the process's mappings.
static std::string loaded_cpu_variant() {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    const std::string marker = "libggml-cpu-";
    while (std::getline(maps, line)) {
        size_t at = line.rfind(marker);
        if (at == std::string::npos) continue;
        std::string rest = line.substr(at + marker.size());
        size_t dot = rest.find(".so");
        return dot == std::string::npos ? rest : rest.substr(0, dot);
    }
    return "unknown";
}

static std::vector<llama_token> parse_ids(const std::string & text) {
    std::vector<llama_token> ids;
    size_t start = 0;
    while (start < text.size()) {
        size_t comma = text.find(',', start);
        std::string piece = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        char * end = nullptr;
        long value = strtol(piece.c_str(), &end, 10);
        if (piece.empty() || *end != '\0' || value < 0) fail("bad token id `" + piece + "` in --ids");
        ids.push_back((llama_token) value);
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return ids;
}

static std::string ids_json(const std::vector<llama_token> & ids) {
    std::string out = "[";
    for (size_t i = 0; i < ids.size(); i++) out += (i ? "," : "") + std::to_string(ids[i]);
    return out + "]";
}

// Decodes `tokens` at positions [first_position, ...) of sequence 0, asking for logits at every position or only
// at the last one.
static void decode(llama_context * context, const std::vector<llama_token> & tokens, int first_position,
                   bool all_logits) {
    llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = first_position + (int32_t) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all_logits || i + 1 == tokens.size();
    }
    batch.n_tokens = (int32_t) tokens.size();
    int32_t status = llama_decode(context, batch);
    llama_batch_free(batch);
    if (status != 0) fail("llama_decode failed with status " + std::to_string(status));
}

// Where --dump-dir writes intermediate tensors, and whether the evaluation running now is the one to dump.
struct TensorDump {
    std::string directory;
    bool active = false;
    std::map<std::string, int> seen;
    FILE * index = nullptr;
};

// The eval callback: asks for every contiguous f32 tensor while a dump is active, then writes it out.
static bool dump_tensor(struct ggml_tensor * tensor, bool ask, void * user_data) {
    TensorDump * dump = (TensorDump *) user_data;
    const bool wanted = dump->active && tensor->type == GGML_TYPE_F32 && ggml_is_contiguous(tensor);
    if (ask || !wanted) return ask ? wanted : true;
    std::string name = ggml_get_name(tensor);
    int count = ++dump->seen[name];
    if (count > 1) name += "#" + std::to_string(count);
    std::vector<float> values((size_t) ggml_nelements(tensor));
    ggml_backend_tensor_get(tensor, values.data(), 0, values.size() * sizeof(float));
    std::string path = dump->directory + "/" + name + ".f32";
    FILE * out = fopen(path.c_str(), "wb");
    if (!out) fail("could not create " + path);
    if (fwrite(values.data(), sizeof(float), values.size(), out) != values.size()) fail("could not write " + path);
    fclose(out);
    fprintf(dump->index, "%s %lld %lld %lld %lld\n", name.c_str(), (long long) tensor->ne[0], (long long) tensor->ne[1],
            (long long) tensor->ne[2], (long long) tensor->ne[3]);
    return true;
}

static llama_token argmax(const float * logits, int vocabulary) {
    return (llama_token) (std::max_element(logits, logits + vocabulary) - logits);
}

// The gap between the largest and the second-largest logit: how close a greedy choice was to a tie.
static double top_two_margin(const float * logits, int vocabulary) {
    float first = -INFINITY, second = -INFINITY;
    for (int i = 0; i < vocabulary; i++) {
        if (logits[i] > first) {
            second = first;
            first = logits[i];
        } else if (logits[i] > second) {
            second = logits[i];
        }
    }
    return (double) first - (double) second;
}

static double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    size_t n = values.size();
    return n == 0 ? 0.0 : (n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2);
}

static std::string doubles_json(const std::vector<double> & values, int decimals) {
    std::string out = "[";
    char number[64];
    for (size_t i = 0; i < values.size(); i++) {
        snprintf(number, sizeof number, "%s%.*f", i ? "," : "", decimals, values[i]);
        out += number;
    }
    return out + "]";
}

int main(int argc, char ** argv) {
    std::string backends, model_path, mode, prompt, ids_text, logits_out, dump_dir;
    int threads = 2, generate = 0, pp = 128, tg = 64, repeats = 5;
    for (int i = 1; i < argc; i++) {
        std::string argument = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) fail(argument + " needs a value");
            return argv[++i];
        };
        if (argument == "--backends") backends = value();
        else if (argument == "--model") model_path = value();
        else if (argument == "--threads") threads = atoi(value().c_str());
        else if (argument == "--prompt") prompt = value();
        else if (argument == "--ids") ids_text = value();
        else if (argument == "--generate") generate = atoi(value().c_str());
        else if (argument == "--logits-out") logits_out = value();
        else if (argument == "--dump-dir") dump_dir = value();
        else if (argument == "--pp") pp = atoi(value().c_str());
        else if (argument == "--tg") tg = atoi(value().c_str());
        else if (argument == "--repeats") repeats = atoi(value().c_str());
        else if (argument == "--verbose") verbose = true;
        else if (argument == "run" || argument == "bench") mode = argument;
        else fail("unknown argument `" + argument + "` (see the comment at the top of llama_ref.cpp)");
    }
    if (backends.empty() || model_path.empty() || mode.empty()) {
        fail("usage: llama_ref --backends DIR --model FILE [--threads N] (run ... | bench ...)");
    }
    if (threads < 1 || generate < 0 || pp < 1 || tg < 1 || repeats < 1) fail("counts must be positive");

    llama_log_set(quiet_log, nullptr);
    ggml_backend_load_all_from_path(backends.c_str());
    llama_backend_init();
    std::string variant = loaded_cpu_variant();
    if (variant == "unknown") fail("no libggml-cpu-*.so could be loaded from " + backends);

    llama_model_params model_parameters = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path.c_str(), model_parameters);
    if (!model) fail("could not load the model " + model_path);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int vocabulary = llama_vocab_n_tokens(vocab);

    std::vector<llama_token> prompt_ids;
    if (mode == "run") {
        if (!ids_text.empty()) {
            prompt_ids = parse_ids(ids_text);
        } else {
            int32_t needed = -llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), nullptr, 0, true, false);
            prompt_ids.resize(std::max(needed, 0));
            llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), prompt_ids.data(),
                           (int32_t) prompt_ids.size(), true, false);
        }
        if (prompt_ids.empty()) fail("the prompt is empty");
        for (llama_token id : prompt_ids) {
            if (id >= vocabulary) fail("token id " + std::to_string(id) + " is outside the vocabulary");
        }
    }
    const int stream_length = mode == "run" ? (int) prompt_ids.size() + generate : pp + tg;

    llama_context_params context_parameters = llama_context_default_params();
    context_parameters.n_ctx = (uint32_t) std::max(stream_length + 16, 256);
    // One ubatch holds the whole stream, so teacher-forced logits come from a single graph evaluation.
    context_parameters.n_batch = context_parameters.n_ctx;
    context_parameters.n_ubatch = context_parameters.n_ctx;
    context_parameters.n_threads = threads;
    context_parameters.n_threads_batch = threads;
    TensorDump dump;
    if (!dump_dir.empty()) {
        if (logits_out.empty()) fail("--dump-dir dumps the teacher-forced evaluation, so it needs --logits-out");
        dump.directory = dump_dir;
        std::string index_path = dump_dir + "/index.txt";
        dump.index = fopen(index_path.c_str(), "w");
        if (!dump.index) fail("could not create " + index_path + " (does the folder exist?)");
        context_parameters.cb_eval = dump_tensor;
        context_parameters.cb_eval_user_data = &dump;
    }
    llama_context * context = llama_init_from_model(model, context_parameters);
    if (!context) fail("could not create a llama context");
    llama_memory_t memory = llama_get_memory(context);

    if (mode == "run") {
        std::vector<llama_token> stream = prompt_ids;
        std::vector<double> margins;
        decode(context, prompt_ids, 0, false);
        for (int step = 0; step < generate; step++) {
            const float * logits = llama_get_logits_ith(context, -1);
            llama_token next = argmax(logits, vocabulary);
            margins.push_back(top_two_margin(logits, vocabulary));
            stream.push_back(next);
            if (step + 1 < generate) decode(context, {next}, (int) stream.size() - 1, false);
        }
        if (!logits_out.empty()) {
            llama_memory_clear(memory, true);
            dump.active = dump.index != nullptr;
            decode(context, stream, 0, true);
            dump.active = false;
            if (dump.index) fclose(dump.index);
            FILE * out = fopen(logits_out.c_str(), "wb");
            if (!out) fail("could not create " + logits_out);
            for (size_t row = 0; row < stream.size(); row++) {
                const float * logits = llama_get_logits_ith(context, (int32_t) row);
                if (fwrite(logits, sizeof(float), (size_t) vocabulary, out) != (size_t) vocabulary) {
                    fail("could not write " + logits_out);
                }
            }
            if (fclose(out) != 0) fail("could not write " + logits_out);
        }
        std::vector<llama_token> generated(stream.begin() + (long) prompt_ids.size(), stream.end());
        printf("{\"variant\":\"%s\",\"vocabulary\":%d,\"prompt_ids\":%s,\"generated_ids\":%s,"
               "\"generated_margins\":%s}\n",
               variant.c_str(), vocabulary, ids_json(prompt_ids).c_str(), ids_json(generated).c_str(),
               doubles_json(margins, 4).c_str());
    } else {
        // Token ids spread over the vocabulary, deterministic; content does not change the cost.
        std::vector<llama_token> prompt_tokens(pp);
        for (int i = 0; i < pp; i++) prompt_tokens[i] = (llama_token) ((1000 + 7919 * i) % vocabulary);
        std::vector<double> pp_rates, tg_rates;
        for (int round = 0; round <= repeats; round++) {  // round 0 is the warm-up
            llama_memory_clear(memory, true);
            auto start = std::chrono::steady_clock::now();
            decode(context, prompt_tokens, 0, false);
            double pp_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

            llama_memory_clear(memory, true);
            llama_token token = prompt_tokens[0];
            start = std::chrono::steady_clock::now();
            for (int i = 0; i < tg; i++) {
                decode(context, {token}, i, false);
                token = argmax(llama_get_logits_ith(context, -1), vocabulary);
            }
            double tg_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (round > 0) {
                pp_rates.push_back(pp / pp_seconds);
                tg_rates.push_back(tg / tg_seconds);
            }
        }
        printf("{\"variant\":\"%s\",\"threads\":%d,\"pp\":%d,\"tg\":%d,\"pp_tokens_per_second\":%s,"
               "\"tg_tokens_per_second\":%s,\"pp_median\":%.2f,\"tg_median\":%.2f}\n",
               variant.c_str(), threads, pp, tg, doubles_json(pp_rates, 2).c_str(), doubles_json(tg_rates, 2).c_str(),
               median(pp_rates), median(tg_rates));
    }

    llama_free(context);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
