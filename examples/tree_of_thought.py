"""Tree of thought: fork the conversation into several ideas, judge them, answer with the best.

    python examples/tree_of_thought.py ["your question"]
    python examples/tree_of_thought.py --url http://127.0.0.1:30000

The forks share the conversation so far: it is computed once and every fork reuses its KV from the
prefix cache. They generate side by side (one batch in the engine), then `select` scores the
candidate numbers in one batched call over the shared prefix.
"""

from __future__ import annotations

import argparse

import radixlm as sgl

NUM_IDEAS = 3


@sgl.function
def tree_of_thought(s, question, num_ideas=NUM_IDEAS):
    s += sgl.system("You are a thoughtful assistant.")
    s += sgl.user(question)
    forks = s.fork(num_ideas)
    for i, f in enumerate(forks):
        f += sgl.assistant(f"Idea {i + 1}: " + sgl.gen("idea", max_tokens=40, stop="\n"))
    forks.join()  # s["idea"] is now the list of the forks' ideas

    listing = "\n".join(f"{i + 1}. {idea.strip()}" for i, idea in enumerate(s["idea"]))
    s += sgl.user(
        f"Here are some ideas:\n{listing}\nWhich idea is the best? Answer with its number."
    )
    s += sgl.assistant(
        "The best idea is number "
        + sgl.select("best", choices=[str(i + 1) for i in range(num_ideas)])
    )
    s += sgl.user("Explain that idea in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=48, temperature=0))


def main(backend=None, question: str = "How can I learn to play the piano faster?"):
    state = tree_of_thought.run(question=question, backend=backend, temperature=0.8)
    for i, idea in enumerate(state["idea"]):
        print(f"idea {i + 1}: {idea.strip()}")
    scores = state.get_meta_info("best")["normalized_prompt_logprobs"]
    print(f"best: {state['best']} (mean logprob per choice: {[round(x, 2) for x in scores]})")
    print(f"answer: {state['answer'].strip()}")
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="How can I learn to play the piano faster?")
    parser.add_argument("--url", help="a radixlm server (default: an in-process engine)")
    args = parser.parse_args()
    main(sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(), args.question)
