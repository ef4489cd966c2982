# Smallest useful deployment: the gateway with the module's defaults (SSE-S3,
# Standard-IA after 30 days, expiry after 180 days, arm64 Lambda).

provider "aws" {
  region = var.region
}

module "kvgate" {
  source = "../.."

  name             = "kvgate"
  lambda_zip_path  = var.lambda_zip_path
  auth_tokens_json = var.auth_tokens_json

  tags = {
    project = "kvgate"
  }
}
