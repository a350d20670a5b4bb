"""What a step is made of, below every room that runs one: the model config resolved once (`resolved`)
and the depths it is simulated at (`depth`), where it runs (`target`), its batch (`batch`), its optimizer
(`optim`), its host pool (`host_pool`) and one rank's shard layout under FSDP2 (`shards`)."""
