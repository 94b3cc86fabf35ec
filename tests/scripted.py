"""A deterministic generation backend for tests that compare parameter updates across batch layouts.

Completion k of a group (k = global row index mod G) depends only on the prompt and k: ragged lengths, and the last
copy of every group never emits EOS (truncated). `offset` is the global index of this process's first row."""

EOS = 258


class ScriptedGeneration:
    def __init__(self, num_generations, max_completion_length, offset=0):
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.offset = offset

    def generate(self, model, prompt_ids):
        out = []
        for i, prompt in enumerate(prompt_ids):
            k = (self.offset + i) % self.num_generations
            seed = sum(prompt) + 31 * k
            if k == self.num_generations - 1:
                out.append([(seed + j) % 200 + 32 for j in range(self.max_completion_length)])
            else:
                out.append([(seed + 7 * j) % 200 + 32 for j in range(1 + k % 5)] + [EOS])
        return out
