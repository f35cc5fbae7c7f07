"""The strategies of conf/strategy: Lightning strategies that implement project.parallel.contract.LlamaStrategy
and apply the model transforms of project.parallel to the model they are given."""
