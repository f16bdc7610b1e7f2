

mock-model 