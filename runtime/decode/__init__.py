"""The speculative decode loop: the small target model, the loop, its stats, the byte tokenizer."""
