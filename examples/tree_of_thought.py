"""Tree of thought: fork the conversation into several ideas, judge them, answer with the best.

    python examples/tree_of_thought.py ["your question"]
    python examples/tree_of_thought.py --url http://127.0.0.1:30000

The forks share the conversation so far: it is computed once and every fork reuses its KV from the
prefix cache. They sample their ideas side by side (one batch in the engine); then `select`
scores every idea as the answer to the question, in one batched call over the shared prefix, and
the best one is explained.

What makes this work on a small model (the default, SmolLM2-135M-Instruct):
- the judge is the model's own likelihood of each idea as the answer (select over the ideas'
  texts), not a question like "which is best? answer with its number": a 135M model answers that
  by position, but it is good at telling a fluent, on-topic sentence from a garbled one;
- each idea is at least a few tokens long (min_tokens: an empty one cannot be chosen) and ideas
  that come out the same are judged once;
- a moderate temperature with top_p: varied ideas, few broken ones.
"""

from __future__ import annotations

import argparse

import radixlm as sgl

NUM_IDEAS = 3


@sgl.function
def tree_of_thought(s, question, num_ideas=NUM_IDEAS):
    s += sgl.system("You give short, practical advice.")
    s += sgl.user(f"{question} Give one tip, in one sentence.")
    forks = s.fork(num_ideas)
    for f in forks:
        f += sgl.assistant(
            sgl.gen("idea", max_tokens=40, min_tokens=4, stop="\n", temperature=0.7, top_p=0.9)
        )
    forks.join()  # s["idea"] is now the list of the forks' ideas
    ideas = list(dict.fromkeys(idea.strip() for idea in s["idea"] if idea.strip()))
    s["ideas"] = ideas
    # the idea the model finds the most likely answer to the question (mean log-prob per token)
    s += sgl.assistant(sgl.select("best", choices=ideas))
    s += sgl.user("Why does that tip help? Answer in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=48, stop="\n", temperature=0))


def main(backend=None, question: str = "How can I learn to play the piano faster?"):
    state = tree_of_thought.run(question=question, backend=backend)
    if state.error() is not None:
        print(f"the program failed: {state.error()}")
        return state
    scores = state.get_meta_info("best")["normalized_prompt_logprobs"]
    for idea, score in zip(state["ideas"], scores):
        print(f"idea ({score:.2f} mean log-prob per token): {idea}")
    print(f"best: {state['best']}")
    print(f"why: {state['answer'].strip()}")
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="How can I learn to play the piano faster?")
    parser.add_argument("--url", help="a radixlm server (default: an in-process engine)")
    args = parser.parse_args()
    if args.url:
        main(sgl.RuntimeEndpoint(args.url), args.question)
    else:
        with sgl.Engine() as engine:  # shut down when done
            main(engine, args.question)
