"""What both adapters (the Trainer's and Fabric's strategies) call to save and load an engine's checkpoints: no
Lightning here, only the choices and the content both share. May import every other checkpoint room."""
