"""Run by vLLM's own Python (not the suite's): `python vllm_score.py MODEL_DIR TOKEN_IDS_JSON SCORES_JSON`
writes the log-probability vLLM gives each token of the sequence after the first."""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model_dir, token_ids, scores_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=len(token_ids) + 1, dtype="float32"
    )
    (output,) = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    scores = [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)]
    with open(scores_path, "w") as file:
        json.dump(scores, file)
    os._exit(0)  # vLLM's CPU engine can abort while it shuts down; the scores are written by then


if __name__ == "__main__":
    main()
