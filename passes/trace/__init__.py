"""Stage 1: the model as a canonical, functional graph (torch.export), with what each op saves for backward."""
