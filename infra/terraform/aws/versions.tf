terraform {
  # 1.9 is the first release whose variable validations may refer to other
  # variables (used to check expiration > transition).
  required_version = ">= 1.9.0, < 2.0.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # Validated against 5.100.0 (the version mirrored for offline CI).
      version = ">= 5.100.0, < 6.0.0"
    }
  }
}
