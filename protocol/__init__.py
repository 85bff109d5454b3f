"""What the client side, the server and the engine share, without torch: request and sampling
parameters (`sampling_params`), prompt tokenization (`prompt_tokens`), and the histogram the
engine's timings travel in (`histogram`). `radixlm.lang` and `radixlm.server` import these, never
`radixlm.runtime`, so a program or an HTTP front end starts without loading torch."""
